"""The fleet: every pgcarve guest on every configured host, and the work of creating and
removing instances (a primary plus its standbys on other hosts).

The fleet never remembers guests itself: `observe()` reads them back from libvirt's metadata
each time, so a restarted manager sees exactly what exists. This module does the work; the
reconciler (scaler.py) decides what work to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import psycopg

from pgcarve.config import FleetConfig, HostConfig, Paths
from pgcarve.errors import CapacityError, ConfigError, GuestNotReady, ImageMissing, NotFound, PgcarveError
from pgcarve.guest.seed import (
    ADMIN_USER,
    CLIENT_DATABASE,
    MANAGER_DATABASE,
    Credentials,
    GuestSeed,
    application_name,
    new_secret,
    slot_name,
    synchronous_standby_names,
    write_seed_iso,
)
from pgcarve.planning.planner import HostPlan, InstanceSlot, PlannerConfig, capacity, plan_host
from pgcarve.planning.topology import HostTopology
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.virt.domain_xml import Disk, DomainSpec, InstanceMetadata, Nic, mac_for
from pgcarve.virt.host import BaseImage, GuestInfo, LibvirtHost

Progress = Callable[[str, str, float], None]  # (guest name, what is happening, fraction done)
BOOT_TIMEOUT_S = float(os.environ.get("PGCARVE_BOOT_TIMEOUT", "600"))


def no_progress(_name: str, _step: str, _fraction: float) -> None:
    pass


@dataclass(frozen=True)
class Guest:
    """One guest as the fleet sees it: libvirt's view plus how to reach it."""

    info: GuestInfo
    address: str | None  # inside the guest network
    endpoint: tuple[str, int] | None  # how this machine reaches PostgreSQL in it

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def host_cpus(self) -> tuple[int, ...]:
        return tuple(sorted({c for row in self.info.vcpu_pins for c in row}))


@dataclass(frozen=True)
class Instance:
    """A primary and its standbys (an immutable snapshot)."""

    index: int
    name: str
    primary: Guest | None
    standbys: tuple[Guest, ...]


def instance_name(fleet: str, index: int) -> str:
    return f"{fleet}-{index:02d}"


def standby_name(fleet: str, index: int, standby: int) -> str:
    return f"{instance_name(fleet, index)}-s{standby}"


def load_credentials(paths: Paths) -> Credentials:
    """The fleet's passwords, created on first use in a 0600 file of the state directory."""
    path = paths.secrets_file
    if path.exists():
        data = json.loads(path.read_text())
        return Credentials(admin_password=data["admin_password"], replication_password=data["replication_password"])
    creds = Credentials(admin_password=new_secret(), replication_password=new_secret())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"admin_password": creds.admin_password, "replication_password": creds.replication_password}, fh)
    return creds


class Fleet:
    """Hosts from the hosts file, connected lazily; does the creating and removing."""

    def __init__(self, config: FleetConfig, paths: Paths):
        self.config = config
        self.paths = paths
        self.hosts = {h.name: LibvirtHost(h.name, h.uri, h.pool, h.pool_path) for h in config.hosts}
        self.forwards = ForwardRegistry(paths.sandbox_dir / "forwards")
        self._credentials: Credentials | None = None
        self._credentials_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._images: dict[str, BaseImage] = {}
        self._topologies: dict[str, HostTopology] = {}
        self._locks = {name: threading.Lock() for name in self.hosts}
        # One piece of work per instance at a time (a scale operation or a fault recovery).
        self._instance_locks: dict[int, threading.Lock] = {}
        self._busy: dict[int, str] = {}
        self._guard = threading.Lock()
        self._removing: dict[str, float] = {}  # guest name -> when we chose to stop it

    # -- who is working on what --------------------------------------------------------------

    @contextlib.contextmanager
    def exclusive(self, index: int, doing: str) -> Iterator[None]:
        """Hold instance `index` for one piece of work; others wait (or skip it, see busy())."""
        with self._guard:
            lock = self._instance_locks.setdefault(index, threading.Lock())
        with lock:
            with self._guard:
                self._busy[index] = doing
            try:
                yield
            finally:
                with self._guard:
                    self._busy.pop(index, None)

    def busy(self, index: int) -> str | None:
        """What work holds instance `index` now, if any."""
        with self._guard:
            return self._busy.get(index)

    def stopping_on_purpose(self, name: str, within_s: float = 120.0) -> bool:
        """Did this manager stop guest `name` itself recently (so a stop event is no fault)?"""
        with self._guard:
            since = self._removing.get(name)
        return since is not None and time.monotonic() - since < within_s

    def _will_stop(self, name: str) -> None:
        with self._guard:
            now = time.monotonic()
            self._removing = {n: t for n, t in self._removing.items() if now - t < 600}
            self._removing[name] = now

    # -- facts -------------------------------------------------------------------------------

    @property
    def credentials(self) -> Credentials:
        with self._credentials_lock:
            if self._credentials is None:
                self._credentials = load_credentials(self.paths)
            return self._credentials

    @property
    def planner_config(self) -> PlannerConfig:
        size = self.config.instance
        return PlannerConfig(vcpus_per_instance=size.vcpus, memory_mib_per_instance=size.memory_mib,
                             housekeeping_cpus=size.housekeeping_cpus, hugepages=size.hugepages)

    def topology(self, host: str) -> HostTopology:
        if host not in self._topologies:
            self._topologies[host] = self.hosts[host].topology()
        return self._topologies[host]

    def capacity(self) -> int:
        """Instances the fleet can hold: primary hosts' slots, limited by the standby hosts'."""
        cfg = self.planner_config
        primary = sum(capacity(self.topology(h.name), cfg) for h in self.config.primary_hosts)
        if self.config.replication.standbys:
            # Standby k of instance i uses slot i on its standby host (see placement()).
            primary = min([primary] + [capacity(self.topology(h.name), cfg) for h in self.config.standby_hosts])
        return primary

    def placement(self, index: int) -> tuple[HostConfig, list[HostConfig]]:
        """Where instance `index` lives: its primary host, and its standbys' hosts in order.

        Primary hosts are filled in order. Standby s goes to standby host (index + s - 2) mod n,
        so an instance's standbys are on different hosts, never on its primary's host, and the
        sync role rotates across standby hosts.
        """
        cfg = self.planner_config
        remaining = index
        primary_host = None
        for host in self.config.primary_hosts:
            cap = capacity(self.topology(host.name), cfg)
            if remaining <= cap:
                primary_host = host
                break
            remaining -= cap
        if primary_host is None:
            raise CapacityError(f"instance {index} exceeds the fleet's capacity of {self.capacity()} instances")
        standby_hosts = self.config.standby_hosts
        chosen = [standby_hosts[(index + s - 2) % len(standby_hosts)]
                  for s in range(1, self.config.replication.standbys + 1)]
        return primary_host, chosen

    def slot(self, host: str, index: int) -> tuple[HostPlan, InstanceSlot]:
        """The CPU slot instance `index` takes on `host` (stable across scaling)."""
        cfg = self.planner_config
        if host in {h.name for h in self.config.primary_hosts}:
            # Index within this host: subtract the capacities of primary hosts before it.
            offset = 0
            for h in self.config.primary_hosts:
                if h.name == host:
                    break
                offset += capacity(self.topology(h.name), cfg)
            local = index - offset
        else:
            local = index
        plan = plan_host(self.topology(host), cfg, local)
        return plan, plan.slots[local - 1]

    def check_capacity(self, instances: int) -> None:
        if instances < 0:
            raise ConfigError(f"instance count must be >= 0, not {instances}")
        cap = self.capacity()
        if instances > cap:
            # Let the planner word the limit for the first host that runs out.
            for host in (*self.config.primary_hosts, *self.config.standby_hosts):
                plan_host(self.topology(host.name), self.planner_config, min(instances, 10**6))
            raise CapacityError(f"the fleet has room for {cap} instances; {instances} requested")
        self.check_storage(instances)

    def check_storage(self, instances: int) -> None:
        """Refuse a scale-up whose new guests would not fit a host's storage pool (disk_reserve_mib each)."""
        reserve = self.config.instance.disk_reserve_mib
        present = {g.metadata.index for g in self.guests()}
        new_guests: dict[str, int] = {}
        for index in range(1, instances + 1):
            if index in present:
                continue
            primary_host, standby_hosts = self.placement(index)
            for host in (primary_host, *standby_hosts):
                new_guests[host.name] = new_guests.get(host.name, 0) + 1
        for host_name, count in sorted(new_guests.items()):
            self.require_free_space(host_name, count * reserve, count)

    def require_free_space(self, host_name: str, needed_mib: int, guests: int = 1) -> None:
        if needed_mib <= 0:
            return
        lv = self.hosts[host_name]
        free = lv.pool_free_mib()
        if free < needed_mib:
            raise CapacityError(
                f"host {host_name}: storage pool {lv.pool_name} ({lv.pool_path}) has {free} MiB free; "
                f"{guests} new guest(s) need {needed_mib} MiB ({self.config.instance.disk_reserve_mib} MiB each, "
                "instance.disk_reserve_mib); free space there or lower the reserve"
            )

    # -- observing ---------------------------------------------------------------------------

    def guests(self) -> list[GuestInfo]:
        found: list[GuestInfo] = []
        for host in self.hosts.values():
            found.extend(host.guests(self.config.fleet))
        return found

    def observe(self, with_endpoints: bool = True) -> list[Instance]:
        """Every instance, rebuilt from libvirt metadata on every host (sorted by index)."""
        by_index: dict[int, list[GuestInfo]] = {}
        for info in self.guests():
            by_index.setdefault(info.metadata.index, []).append(info)
        instances = []
        for index in sorted(by_index):
            members = by_index[index]
            primary = next((g for g in members if g.metadata.role == "primary"), None)
            standbys = sorted((g for g in members if g.metadata.role == "standby"), key=lambda g: g.metadata.standby)
            instances.append(Instance(
                index=index,
                name=instance_name(self.config.fleet, index),
                primary=self._guest(primary, with_endpoints) if primary else None,
                standbys=tuple(self._guest(g, with_endpoints) for g in standbys),
            ))
        return instances

    def instance(self, name: str) -> Instance:
        for inst in self.observe():
            if inst.name == name:
                return inst
        raise NotFound(f"no instance named {name!r}")

    def _guest(self, info: GuestInfo, with_endpoint: bool) -> Guest:
        if not with_endpoint or info.state != "running":
            return Guest(info=info, address=None, endpoint=None)
        host = self.config.host(info.host)
        address = self.hosts[info.host].guest_address(info.name, host.network, info.mac)
        return Guest(info=info, address=address, endpoint=self._endpoint(host, info.name, address))

    def _endpoint(self, host: HostConfig, name: str, address: str | None) -> tuple[str, int] | None:
        if address is None:
            return None
        if host.reach == "direct":
            return address, 5432
        if host.netns is None:
            raise ConfigError(f"host {host.name}: reach: sandbox needs netns")
        fwd = self.forwards.ensure(name, f"/run/netns/{host.netns}", f"{address}:5432")
        return "127.0.0.1", fwd.port

    def dsn(self, endpoint: tuple[str, int], with_password: bool = False) -> str:
        host, port = endpoint
        password = f":{self.credentials.admin_password}" if with_password else ""
        return f"postgresql://{ADMIN_USER}{password}@{host}:{port}/postgres"

    def connect(self, guest: Guest, timeout_s: float = 5.0, database: str = MANAGER_DATABASE) -> psycopg.Connection:
        """An autocommit admin session on the guest's PostgreSQL.

        pgcarve's own work runs in MANAGER_DATABASE, so the collector never counts it as the
        clients'; pass ``database`` to act in a client database (e.g. the load's table).
        """
        if guest.endpoint is None:
            raise GuestNotReady(f"{guest.name} has no address yet")
        host, port = guest.endpoint

        def open_session(dbname: str) -> psycopg.Connection:
            return psycopg.connect(host=host, port=port, user=ADMIN_USER, password=self.credentials.admin_password,
                                   dbname=dbname, connect_timeout=int(max(1, timeout_s)), autocommit=True,
                                   application_name="pgcarve-manager")

        try:
            return open_session(database)
        except psycopg.errors.InvalidCatalogName:
            if database != MANAGER_DATABASE:
                raise
            # A guest from an image older than the manager database: its work counts as clients'.
            return open_session(CLIENT_DATABASE)

    # -- preparing hosts ---------------------------------------------------------------------

    def image_on(self, host: str) -> BaseImage:
        with self._locks[host]:
            if host not in self._images:
                image_dir = self.paths.image_dir
                if not (image_dir / "inputs.sha256").exists():
                    raise ImageMissing(
                        f"no guest image in {image_dir}: build it with `make image` "
                        f"(or images/build.sh {image_dir})"
                    )
                self._images[host] = self.hosts[host].ensure_base_image(image_dir)
            return self._images[host]

    def domain_type(self, host: str) -> str:
        """kvm where a probe shows a guest really boots under KVM on this host, else qemu (TCG)."""
        if self.config.domain_type != "auto":
            return self.config.domain_type
        with self._probe_lock:  # parallel creations on one host probe it once
            cache_file = self.paths.probe_cache
            cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
            uri = self.config.host(host).uri
            if uri not in cache:
                ok, why = self.hosts[host].probe_kvm(self.image_on(host))
                cache[uri] = {"domain_type": "kvm" if ok else "qemu", "why": why}
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                cache_file.write_text(json.dumps(cache, indent=2))
            return str(cache[uri]["domain_type"])

    # -- creating ----------------------------------------------------------------------------

    def domain_spec(self, host: HostConfig, name: str, meta: InstanceMetadata, image: BaseImage,
                    domain_type: str, creating: bool = False) -> DomainSpec:
        """The domain for guest `name` on `host`: its planned slot, its disks, its NIC."""
        plan, slot = self.slot(host.name, meta.index)
        return DomainSpec(
            name=name,
            domain_type=domain_type,  # type: ignore[arg-type]
            metadata=meta,
            memory_mib=slot.memory_mib,
            vcpu_pins=slot.host_cpus,
            emulator_cpus=plan.emulator_cpus,
            numa_node=slot.numa_node,
            hugepages=self.config.instance.hugepages,
            kernel=image.kernel_path,
            initrd=image.initrd_path,
            disks=(Disk("vda", host.pool, f"{name}.qcow2"),
                   Disk("vdb", host.pool, f"{name}-seed.iso", format="raw", readonly=True)),
            nics=(Nic(host.network, mac_for(self.config.fleet, name)),),
            console_log=f"/var/log/libvirt/qemu/{name}-console.log",
            creating=creating,
        )

    def _create_guest(self, host: HostConfig, name: str, meta: InstanceMetadata, seed: GuestSeed,
                      progress: Progress) -> None:
        lv = self.hosts[host.name]
        image = self.image_on(host.name)
        self.require_free_space(host.name, self.config.instance.disk_reserve_mib)
        progress(name, f"disk and seed on {host.name}", 0.1)
        disk = f"{name}.qcow2"
        seed_volume = f"{name}-seed.iso"
        lv.create_overlay(disk, image.disk, self.config.instance.disk_gib)
        with tempfile.TemporaryDirectory(prefix="pgcarve-") as tmp:
            iso = Path(tmp) / "seed.iso"
            write_seed_iso(seed, f"{name}-{int(time.time())}", iso)
            lv.upload_file(seed_volume, iso)
        spec = self.domain_spec(host, name, meta, image, self.domain_type(host.name), creating=True)
        progress(name, f"starting on {host.name} CPUs {','.join(map(str, spec.vcpu_pins))}", 0.2)
        lv.define_and_start(spec)

    def wait_sql(self, host: HostConfig, name: str, progress: Progress, standby: bool = False) -> Guest:
        """Wait until PostgreSQL in the guest accepts our login (and, for a standby, is in recovery)."""
        lv = self.hosts[host.name]
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        started = time.monotonic()
        last_error = "no address yet"
        while time.monotonic() < deadline:
            info = lv.guest(name)
            if info.state == "paused":
                errors = lv.disk_errors(name)
                if "no space left" in errors.values():
                    raise CapacityError(
                        f"{name} on {host.name}: its disk ran out of space while booting (storage pool "
                        f"{lv.pool_name} at {lv.pool_path} is full); free space there or lower instance.disk_gib"
                    )
                if errors:
                    raise GuestNotReady(f"{name} on {host.name} stopped on a disk error: {errors}")
            if info.state not in ("running", "paused"):
                raise GuestNotReady(f"{name} on {host.name} stopped while booting (state {info.state})")
            guest = self._guest(info, with_endpoint=True)
            if guest.endpoint is not None:
                try:
                    with self.connect(guest, timeout_s=3) as conn:
                        in_recovery = conn.execute("select pg_is_in_recovery()").fetchone()
                        if in_recovery is not None and bool(in_recovery[0]) == standby:
                            return guest
                        last_error = "not in the expected role yet"
                except psycopg.Error as exc:
                    last_error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            elapsed = time.monotonic() - started
            progress(name, "booting" if guest.endpoint is None else "waiting for PostgreSQL",
                     min(0.9, 0.25 + 0.65 * elapsed / 60))
            time.sleep(0.5)
        raise GuestNotReady(f"{name} on {host.name} did not accept SQL within {BOOT_TIMEOUT_S:.0f} s: {last_error}")

    def create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        """Create instance `index`: its primary, then its standbys cloned from it, and wait
        until the primary accepts SQL and every standby streams from it.

        On any failure the instance's guests and disks are removed again, so a failed
        scale-up leaves nothing half-made (the instance held no acknowledged data yet).
        """
        with self.exclusive(index, "creating"):
            try:
                instance = self._create_instance(index, progress)
            except BaseException:
                self.discard_instance(index)
                raise
            for guest in (*((instance.primary,) if instance.primary else ()), *instance.standbys):
                self.hosts[guest.info.host].mark_complete(guest.name)
            return instance

    def discard_instance(self, index: int) -> None:
        """Remove whatever exists of instance `index`: guests and their volumes."""
        fleet = self.config.fleet
        names = [instance_name(fleet, index)] + [standby_name(fleet, index, s)
                                                 for s in range(1, self.config.replication.standbys + 1)]
        for host in self.hosts.values():
            for name in names:
                self._will_stop(name)
                with contextlib.suppress(PgcarveError):
                    host.destroy(name)
                for volume in (f"{name}.qcow2", f"{name}-seed.iso"):
                    with contextlib.suppress(PgcarveError):
                        host.delete_volume(volume)
                self.forwards.remove(name)

    def primary_seed(self, name: str, standby_names: list[str]) -> GuestSeed:
        repl = self.config.replication
        return GuestSeed(
            name=name, role="primary", credentials=self.credentials,
            allowed_cidrs=tuple(self.config.allowed_cidrs),
            synchronous_commit=repl.synchronous_commit,
            synchronous_standby_names=self.sync_names(standby_names),
        )

    def sync_names(self, standby_names: list[str]) -> str:
        """synchronous_standby_names for a primary whose standbys are these guests, in priority order."""
        repl = self.config.replication
        if not standby_names:
            return ""
        return synchronous_standby_names(repl.sync_mode, min(repl.sync_count, len(standby_names)), standby_names)

    def _create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        fleet = self.config.fleet
        name = instance_name(fleet, index)
        primary_host, standby_hosts = self.placement(index)
        standby_names = [standby_name(fleet, index, s) for s in range(1, len(standby_hosts) + 1)]
        meta = InstanceMetadata(fleet=fleet, cluster=name, role="primary", index=index)
        self._create_guest(primary_host, name, meta, self.primary_seed(name, standby_names), progress)
        primary = self.wait_sql(primary_host, name, progress)
        progress(name, "primary accepts SQL", 1.0 if not standby_names else 0.6)
        if not standby_names:
            return self.instance(name)
        with ThreadPoolExecutor(max_workers=len(standby_names)) as pool:
            futures = [pool.submit(self.create_standby, primary, host, sname, s, progress)
                       for s, (sname, host) in enumerate(zip(standby_names, standby_hosts, strict=True), start=1)]
            for future in futures:
                future.result()
        self.wait_streaming(primary, standby_names, progress)
        progress(name, "ready", 1.0)
        return self.instance(name)

    def create_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                       progress: Progress = no_progress) -> Guest:
        """A new standby guest `name` on `host`, cloned (pg_basebackup) from `primary` through a
        physical slot of its own; returns once it replays in recovery."""
        if primary.address is None:
            raise GuestNotReady(f"{primary.name} has no address to clone a standby from")
        with self.connect(primary) as conn:
            conn.execute(
                "select pg_create_physical_replication_slot(%s, true) "
                "where not exists (select 1 from pg_replication_slots where slot_name = %s)",
                (slot_name(name), slot_name(name)),
            )
        meta = primary.info.metadata
        smeta = InstanceMetadata(fleet=meta.fleet, cluster=meta.cluster, role="standby", index=meta.index,
                                 standby=number)
        seed = replace(self.primary_seed(name, []), role="standby", primary_host=primary.address)
        self._create_guest(host, name, smeta, seed, progress)
        guest = self.wait_sql(host, name, progress, standby=True)
        progress(name, "standby replaying", 1.0)
        return guest

    def wait_streaming(self, primary: Guest, standbys: list[str], progress: Progress,
                       timeout_s: float = 300) -> None:
        wanted = {application_name(s) for s in standbys}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.connect(primary) as conn:
                rows = conn.execute(
                    "select application_name from pg_stat_replication where state = 'streaming'"
                ).fetchall()
            if wanted <= {r[0] for r in rows}:
                return
            progress(primary.name, "waiting for standbys to stream", 0.9)
            time.sleep(0.5)
        raise GuestNotReady(f"standbys of {primary.name} ({', '.join(sorted(wanted))}) are not streaming "
                            f"after {timeout_s:.0f} s")

    # -- removing ----------------------------------------------------------------------------

    def remove_guest(self, info: GuestInfo) -> None:
        lv = self.hosts[info.host]
        self._will_stop(info.name)
        lv.destroy(info.name)
        for volume in (f"{info.name}.qcow2", f"{info.name}-seed.iso"):
            lv.delete_volume(volume)
        self.forwards.remove(info.name)

    def remove_instance(self, instance: Instance) -> None:
        """Power off and delete a primary, its standbys and their disks (no data kept)."""
        for guest in (*instance.standbys, *((instance.primary,) if instance.primary else ())):
            self.remove_guest(guest.info)

    def discard_half_made(self) -> list[str]:
        """After a manager crash: remove what a killed operation left half-built (guests still
        marked "creating"), and volumes of this fleet that no guest uses.

        An instance whose guests are *all* marked was being created by a scale-up and never
        finished: it never held an acknowledged commit, so it goes whole. Otherwise the instance
        holds data: only a standby that was being rebuilt goes (the HA loop builds it again),
        and a primary still marked is one whose marking was cut short, so it is marked complete.

        Call before any operation runs (manager start, `pgcarve up`): it assumes nothing is being
        built right now."""
        removed = []
        guests = self.guests()
        marked = {g.metadata.index for g in guests if g.creating and g.metadata.created_by == "manager"}
        for index in sorted(marked):
            members = [g for g in guests if g.metadata.index == index]
            name = instance_name(self.config.fleet, index)
            if all(g.creating for g in members):
                self.discard_instance(index)
                removed.append(f"half-made instance {name} ({', '.join(sorted(g.name for g in members))})")
                continue
            for guest in members:
                if not guest.creating:
                    continue
                if guest.metadata.role == "standby":
                    self.remove_guest(guest)
                    removed.append(f"half-built standby {guest.name} of {name} on {guest.host} "
                                   "(the instance keeps its data; the standby is built again)")
                else:
                    self.hosts[guest.host].mark_complete(guest.name)
        prefix = f"{self.config.fleet}-"
        for host_name, lv in self.hosts.items():
            for volume in sorted(lv.volume_names()):
                owner = volume.removesuffix(".qcow2").removesuffix("-seed.iso")
                if volume.startswith(prefix) and owner != volume and not lv.defined(owner):
                    lv.delete_volume(volume)
                    removed.append(f"volume {volume} on {host_name} (no guest uses it)")
        return removed

    def leftovers(self) -> list[str]:
        """Any pgcarve guest or volume of this fleet still on a host."""
        left = [f"guest {g.name} on {g.host}" for g in self.guests()]
        prefix = f"{self.config.fleet}-"
        for name, host in self.hosts.items():
            with contextlib.suppress(PgcarveError):
                left += [f"volume {v} on {name}" for v in sorted(host.volume_names()) if v.startswith(prefix)]
        return left

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
