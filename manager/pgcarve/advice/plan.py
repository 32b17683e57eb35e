"""What `pgcarve advise` would carve, decided before anything is created: the request checked
against the hosts (an empty primary host, or its free slots with --spare; a standby host; N within
capacity), the N values, the cases' fleets, and how long it would take. Reads the hosts, changes
nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgcarve.advice.cases import CARVED, MULTI_INSTANCE, SINGLE, with_size
from pgcarve.advice.rounds import CaseGroup
from pgcarve.config import MAX_CLUSTERS, FleetConfig, HostConfig
from pgcarve.control.fleet import Fleet
from pgcarve.errors import CapacityError, ConfigError, Conflict
from pgcarve.planning.placement import planner_config
from pgcarve.planning.planner import PlannerConfig, capacity, plan_host
from pgcarve.planning.topology import HostTopology, parse_capabilities, with_cores_rotated

MIN_SECONDS = 5  # pgbench's progress and the wait sampler need a few seconds to mean anything
RAMP_SECONDS = 5
RAMP_CLIENTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Rough costs for the estimate (seconds): making and removing one group's guests, and what a
# pgbench run adds to its duration (connections, CPU samples, latency logs).
BOOT_S = {"kvm": 40.0, "qemu": 90.0}
REMOVE_S = 10.0
RUN_OVERHEAD_S = 8.0


@dataclass(frozen=True)
class AdviceRequest:
    """`pgcarve advise`'s options (POST /v1/advice's body)."""

    host: str | None = None  # default: the fleet's first primary host
    max_instances: int | None = None  # default: the host's capacity
    seconds: int = 30
    repeat: int = 3
    clients: int | None = None  # total per case; None: found by a short ramp
    spare: bool = False
    image_dir: Path | None = None

    def check(self) -> None:
        """ConfigError for options that are wrong whatever the hosts."""
        if self.seconds < MIN_SECONDS:
            raise ConfigError(f"--seconds {self.seconds}: each run needs at least {MIN_SECONDS} s")
        if self.repeat < 1:
            raise ConfigError(f"--repeat {self.repeat}: at least 1 run of each case (3 or more for a verdict "
                              "beyond the noise)")
        if self.max_instances is not None and self.max_instances < 2:
            raise ConfigError(f"--max-instances {self.max_instances}: at least 2 (carving into 1 compares nothing)")
        if self.clients is not None and self.clients < 1:
            raise ConfigError(f"--clients {self.clients}: at least 1")


@dataclass(frozen=True)
class AdvicePlan:
    host: str
    standby_hosts: tuple[str, ...]
    standbys: int
    vcpus: int  # V per carved guest
    ns: tuple[int, ...]  # carved instance counts
    single_vcpus: int
    clusters: int
    seconds: int
    repeat: int
    clients: int | None
    domain_type: str | None  # None: not probed yet
    occupied: tuple[str, ...]  # guests on the host left alone (--spare)
    core_offset: int  # where the advice's slots start on the host (--spare)
    groups: tuple[CaseGroup, ...]
    image_dir: str

    @property
    def largest(self) -> int:
        return self.ns[-1]

    def estimate_s(self) -> float:
        boot = BOOT_S.get(self.domain_type or "qemu", BOOT_S["qemu"])
        per_round = sum(boot + REMOVE_S + len(g.cases) * (self.seconds + RUN_OVERHEAD_S) for g in self.groups)
        ramp = 0.0 if self.clients is not None else boot + REMOVE_S + len(RAMP_CLIENTS) * (RAMP_SECONDS + 3)
        return per_round * self.repeat + ramp

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host, "standby_hosts": list(self.standby_hosts), "standbys_per_primary": self.standbys,
            "vcpus_per_guest": self.vcpus, "instances": list(self.ns), "single_vcpus": self.single_vcpus,
            "clusters": self.clusters, "seconds": self.seconds, "repeat": self.repeat,
            "clients": self.clients if self.clients is not None else "ramp", "domain_type": self.domain_type,
            "left_alone": list(self.occupied), "core_offset": self.core_offset, "image_dir": self.image_dir,
            "cases": [{"cases": [key for key, _ in g.cases], "instances": g.instances,
                       "vcpus": g.config.instance.vcpus, "clusters": g.config.instance.clusters,
                       "guests": g.instances * (1 + g.config.replication.standbys)} for g in self.groups],
            "runs": self.repeat * sum(len(g.cases) for g in self.groups),
            "estimate_s": round(self.estimate_s()),
        }

    def describe(self) -> list[str]:
        """The plan in lines an operator reads before a long run."""
        lines = [f"host {self.host}, standbys on {', '.join(self.standby_hosts)} ({self.standbys} per primary); "
                 f"guests of {self.vcpus} vCPU; image {self.image_dir}"]
        if self.occupied:
            lines.append(f"--spare: {len(self.occupied)} guest(s) already on {self.host} are left alone "
                         f"({', '.join(self.occupied)}); the advice uses the free slots only")
        for g in self.groups:
            standbys = g.instances * g.config.replication.standbys
            lines.append(f"  {', '.join(key for key, _ in g.cases)}: {g.instances} instance(s) of "
                         f"{g.config.instance.vcpus} vCPU"
                         + (f", {g.config.instance.clusters} PostgreSQL clusters" if g.config.instance.clusters > 1
                            else "")
                         + f" + {standbys} standby guest(s)")
        clients = f"{self.clients} clients per case" if self.clients is not None else \
            f"clients found by a ramp ({RAMP_SECONDS} s runs at {', '.join(map(str, RAMP_CLIENTS[:6]))}, ...)"
        runs = self.repeat * sum(len(g.cases) for g in self.groups)
        kind = self.domain_type or "not probed yet (estimated as emulation)"
        lines.append(f"{runs} pgbench runs of {self.seconds} s ({self.repeat} round(s)), {clients}; guests: {kind}")
        lines.append(f"estimated time: about {self.estimate_s() / 60:.0f} min")
        return lines


def advice_base(config: FleetConfig, host: HostConfig, core_offset: int) -> FleetConfig:
    """The fleet config the cases are carved from: the chosen primary host (slots from
    core_offset) and every standby host, with at least one synchronous standby per primary."""
    raw = config.model_dump(mode="json")
    raw["hosts"] = [{**host.model_dump(mode="json"), "core_offset": core_offset},
                    *[h.model_dump(mode="json") for h in config.standby_hosts]]
    raw["replication"]["standbys"] = max(1, config.replication.standbys)
    raw["replication"]["sync_count"] = min(config.replication.sync_count, raw["replication"]["standbys"])
    return FleetConfig.model_validate(raw)


def powers_up_to(top: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `top`, then `top`."""
    found, n = [], 1
    while n < top:
        found.append(n)
        n *= 2
    return (*found, top)


def spare_offset(raw: HostTopology, base_offset: int, planner: PlannerConfig,
                 occupied_cpus: frozenset[int]) -> tuple[int, int]:
    """(core offset, free slots) for a host that already runs guests: the rotation of its slot
    layout (see with_cores_rotated) whose housekeeping CPUs and most leading slots avoid every CPU
    those guests' vCPUs and emulator threads are pinned to. Slots past the first clash are not
    used, so this may leave some free cores aside; it never shares one."""
    best = (base_offset, 0)
    cores = len({(c.socket, c.core) for c in raw.cpus}) or 1
    for extra in range(cores):
        topology = with_cores_rotated(raw, base_offset + extra)
        plan = plan_host(topology, planner, capacity(topology, planner))
        if occupied_cpus & set(plan.emulator_cpus):
            continue
        free = 0
        for slot in plan.slots:
            if occupied_cpus & set(slot.host_cpus):
                break
            free += 1
        if free > best[1]:
            best = (base_offset + extra, free)
    return best


def plan_advice(fleet: Fleet, request: AdviceRequest) -> AdvicePlan:
    """Check `request` against the hosts and plan it (CapacityError, ConfigError or Conflict,
    naming the problem and the limit, before anything is created)."""
    request.check()
    config = fleet.config
    if request.host is None:
        if not config.primary_hosts:
            raise ConfigError("the hosts file has no primary host")
        host = config.primary_hosts[0]
    else:
        names = [h.name for h in config.hosts]
        if request.host not in names:
            raise ConfigError(f"--host {request.host}: not in the hosts file (hosts: {', '.join(names)})")
        host = config.host(request.host)
        if host.role != "primary":
            raise ConfigError(f"--host {host.name}: a standby host; advise carves a primary host "
                              f"({', '.join(h.name for h in config.primary_hosts) or 'none in the hosts file'})")
    if not config.standby_hosts:
        raise ConfigError("advise measures primaries with synchronous standbys on other hosts, as in production: "
                          "the hosts file has no host with role: standby")
    # Guests of any fleet: the operator's, another advice's, a benchmark's.
    on_host = sorted(fleet.hosts[host.name].guests(), key=lambda g: g.name)
    planner = planner_config(config.instance)
    raw = parse_capabilities(fleet.hosts[host.name].capabilities())
    offset = host.core_offset
    if on_host and not request.spare:
        raise Conflict(f"host {host.name} holds {len(on_host)} guest(s) ({', '.join(g.name for g in on_host)}): "
                       "advise carves an empty host; remove them, choose another --host, or pass --spare to use "
                       "only its free slots")
    if on_host:
        pinned = frozenset({cpu for g in on_host for pins in g.vcpu_pins for cpu in pins}
                           | {cpu for g in on_host for cpu in g.emulator_cpus})
        offset, room = spare_offset(raw, host.core_offset, planner, pinned)
    else:
        room = capacity(with_cores_rotated(raw, offset), planner)
    base = advice_base(config, host, offset)
    standby_room = min(capacity(fleet.topology(h.name), planner) for h in config.standby_hosts)
    limit = min(room, standby_room)
    what = f"{config.instance.vcpus} vCPU, {config.instance.memory_mib} MiB"
    free = "free " if on_host else ""
    if request.max_instances is not None and request.max_instances > limit:
        raise CapacityError(f"--max-instances {request.max_instances}: host {host.name} has room for {room} "
                            f"{free}instance(s) of {what}, and the standby hosts for {standby_room}; at most {limit}")
    if limit < 2:
        raise CapacityError(f"host {host.name} has room for {limit} {free}instance(s) of {what} (standby hosts: "
                            f"{standby_room}): carving needs room for 2 or more; lower instance.vcpus")
    top = min(limit, request.max_instances or limit)
    ns = powers_up_to(top)
    v = config.instance.vcpus
    # The single instance gets all the carved guests' vCPUs, if one guest that big fits; else the largest that does.
    single_n = top
    while single_n > 1 and capacity(with_cores_rotated(raw, offset),
                                    planner_config(config.instance.model_copy(update={"vcpus": v * single_n}))) < 1:
        single_n -= 1
    clusters = min(top, MAX_CLUSTERS)
    groups = [CaseGroup(f"c{n}", with_size(base, vcpus=v), n, n, ((f"{CARVED}-{n}", CARVED),)) for n in ns]
    groups.append(CaseGroup("s", with_size(base, vcpus=v * single_n), 1, single_n, ((SINGLE, SINGLE),)))
    groups.append(CaseGroup("m", with_size(base, vcpus=v * single_n, clusters=clusters), 1, clusters,
                            ((MULTI_INSTANCE, MULTI_INSTANCE),)))
    return AdvicePlan(
        host=host.name, standby_hosts=tuple(h.name for h in config.standby_hosts),
        standbys=base.replication.standbys, vcpus=v, ns=ns, single_vcpus=v * single_n, clusters=clusters,
        seconds=request.seconds, repeat=request.repeat, clients=request.clients,
        domain_type=known_domain_type(fleet, host), occupied=tuple(g.name for g in on_host), core_offset=offset,
        groups=tuple(groups), image_dir=str(request.image_dir or fleet.paths.image_dir))


def known_domain_type(fleet: Fleet, host: HostConfig) -> str | None:
    """kvm or qemu if the hosts file says or an earlier probe found out; None otherwise (probing
    boots a guest, which a plan does not do)."""
    if fleet.config.domain_type != "auto":
        return fleet.config.domain_type
    try:
        cache = json.loads(fleet.paths.probe_cache.read_text())
        return str(cache[host.uri]["domain_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
