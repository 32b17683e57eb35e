"""What is retired: the marker volumes kept beside a retired instance's disks.

A retired instance has no libvirt domain, only disks. Beside each kept disk a marker volume
records the retirement, on the host, with the data:

    <guest>.retired.<index>.<role>.<unix time>.<image tag>.<roles>     role: primary | standby<N>

so a manager that lost its state still sees it, and never takes a retired disk for an orphan.
<roles> says who decided the instance's roles (its metadata's, control/roles_guard.py); a marker
of an earlier release has none and reads as the manager's, as its guests' metadata does.
Retiring, bringing back and purging are control/retirement.py.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Container, Iterable
from dataclasses import dataclass, replace

from pgcarve.control.fleet import Fleet
from pgcarve.control.roles_guard import configured_roles, mismatch
from pgcarve.errors import PgcarveError
from pgcarve.naming import disk_volume, guest_of, instance_name
from pgcarve.virt.domain_xml import EARLIER_ROLES, InstanceMetadata, Roles

log = logging.getLogger(__name__)


MARKER_RE = re.compile(r"^(?P<guest>[a-z0-9-]+)\.retired\.(?P<index>[0-9]+)\.(?P<role>primary|standby[0-9]+)"
                       r"\.(?P<at>[0-9]+)\.(?P<tag>[0-9a-z]*)(\.(?P<roles>manager|patroni))?$")


@dataclass(frozen=True)
class RetiredGuest:
    """One kept guest disk of a retired instance, as its marker volume records it."""

    name: str
    host: str
    index: int
    role: str  # "primary" or "standby"
    standby: int  # 0 for a primary
    retired_at: float  # unix time
    image_tag: str
    disk_mib: int  # space its disk takes now
    roles: Roles | None = None  # None: a marker of an earlier release (the manager's roles)

    @property
    def marker(self) -> str:
        return marker_name(self.name, self.index, self.role, self.standby, self.retired_at, self.image_tag,
                           self.roles)

    @property
    def decided_by(self) -> Roles:
        return self.roles or EARLIER_ROLES

    def metadata(self, fleet: str) -> InstanceMetadata:
        return InstanceMetadata(fleet=fleet, cluster=instance_name(fleet, self.index), role=self.role,  # type: ignore[arg-type]
                                index=self.index, standby=self.standby, roles=self.decided_by)


@dataclass(frozen=True)
class RetiredInstance:
    name: str
    index: int
    guests: tuple[RetiredGuest, ...]
    roles_mismatch: str | None = None  # as an Instance's (control/roles_guard.py)

    @property
    def retired_at(self) -> float:
        return min(g.retired_at for g in self.guests)

    @property
    def disk_mib(self) -> int:
        return sum(g.disk_mib for g in self.guests)

    def disk_mib_on(self, host: str) -> int:
        return sum(g.disk_mib for g in self.guests if g.host == host)


def marker_name(guest: str, index: int, role: str, standby: int, at: float, tag: str,
                roles: Roles | None = None) -> str:
    role_text = "primary" if role == "primary" else f"standby{standby}"
    return f"{guest}.retired.{index}.{role_text}.{int(at)}.{tag}" + (f".{roles}" if roles else "")


def parse_marker(volume: str, host: str, disk_mib: int = 0) -> RetiredGuest | None:
    found = MARKER_RE.fullmatch(volume)
    if found is None:
        return None
    role = found["role"]
    return RetiredGuest(name=found["guest"], host=host, index=int(found["index"]),
                        role="primary" if role == "primary" else "standby",
                        standby=0 if role == "primary" else int(role.removeprefix("standby")),
                        retired_at=float(found["at"]), image_tag=found["tag"], disk_mib=disk_mib,
                        roles=found["roles"])  # type: ignore[arg-type]  # the pattern allows only the two


# Hosts whose retired disks could not be listed: said once per outage, not on every read (the
# API and the HA loop read every few seconds while a host is lost).
_unlisted_hosts: set[str] = set()


def retired_instances(fleet: Fleet, only: str | None = None) -> list[RetiredInstance]:
    """Every retired instance of this fleet, read from the marker volumes on the hosts that answer
    (`only`: just the instance of that name, whose markers alone are parsed and sized)."""
    by_index: dict[int, list[RetiredGuest]] = {}
    prefix = f"{fleet.config.fleet}-" if only is None else only
    for host_name, lv in fleet.hosts.items():
        try:
            found = [g for v in lv.storage.volume_names() if v.startswith(prefix)
                     for g in (parse_marker(v, host_name),)
                     if g is not None and (only is None or guest_of(only, g.name))]
            sizes = lv.storage.allocations_mib([disk_volume(g.name) for g in found]) if found else {}
        except PgcarveError as exc:
            if host_name not in _unlisted_hosts:
                _unlisted_hosts.add(host_name)
                log.warning("host %s: cannot list retired disks (its retired instances are left out of listings "
                            "until it answers): %s", host_name, exc)
            continue
        if host_name in _unlisted_hosts:
            _unlisted_hosts.discard(host_name)
            log.info("host %s: its retired disks are listed again", host_name)
        for guest in found:
            by_index.setdefault(guest.index, []).append(replace(guest, disk_mib=sizes.get(disk_volume(guest.name), 0)))
    roles = configured_roles(fleet.config)
    return [RetiredInstance(name=instance_name(fleet.config.fleet, index), index=index,
                            guests=tuple(sorted(guests, key=lambda g: (g.standby, g.name))),
                            roles_mismatch=mismatch(instance_name(fleet.config.fleet, index),
                                                    ((g.name, g.decided_by) for g in guests), roles))
            for index, guests in sorted(by_index.items())]


def retired_instance(fleet: Fleet, name: str) -> RetiredInstance | None:
    return next((r for r in retired_instances(fleet, only=name) if r.name == name), None)


def in_the_way(retired: Iterable[RetiredInstance], host: str, reviving: Container[int] = ()) -> str:
    """Words for a storage refusal: the kept disks on `host` of instances that stay retired."""
    kept = [r for r in retired if r.index not in reviving and r.disk_mib_on(host)]
    if not kept:
        return ""
    listed = ", ".join(f"{r.name} ({r.disk_mib_on(host)} MiB)" for r in kept)
    return (f"; retired instances keep their disks there: {listed}; `pgcarve purge NAME` deletes one "
            "for good")


def retired_doc(retired: RetiredInstance) -> dict[str, object]:
    """A retired instance as GET /v1/instances?include=retired lists it (shaped like a running one)."""
    primary = next((g for g in retired.guests if g.role == "primary"), None)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(retired.retired_at))
    return {
        "name": retired.name,
        "host": primary.host if primary else None,
        "state": "retired",
        "writes": f"none: retired since {when}; its disks are kept ({retired.disk_mib} MiB): scaling up brings it "
                  f"back, `pgcarve purge {retired.name}` deletes it",
        "incident": retired.roles_mismatch,
        "vcpus": [],
        "memory_mib": 0,
        "dsn": None,
        "retired_at": retired.retired_at,
        "disk_mib": retired.disk_mib,
        "standbys": [{"name": g.name, "host": g.host, "state": "retired", "sync_state": None,
                      "replay_lag_bytes": None} for g in retired.guests if g is not primary],
    }
