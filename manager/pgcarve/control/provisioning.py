"""Creating instances: a primary, then its standbys cloned from it on other hosts.

Each guest boots from a qcow2 overlay of the image and a NoCloud seed, pinned to its planned
slot, marked "creating" in its libvirt metadata until its whole instance is built (so a manager
killed half-way knows what it never finished: control/removal.py). A seed carries the guest's
certificate from the fleet CA and its instance's own passwords (made with the primary's seed).
A standby clones itself once its primary lets its address in (control/access.py), which is done
as soon as the standby has an address.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg

from pgcarve.config import HostConfig
from pgcarve.control.access import refresh_replication_access
from pgcarve.control.capacity import require_free_space
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.removal import discard_instance
from pgcarve.errors import CapacityError, GuestNotReady, PgcarveError
from pgcarve.guest.credentials import InstanceSecrets
from pgcarve.guest.seed import GuestSeed, Role, write_seed_iso
from pgcarve.naming import application_name, instance_name, slot_name, standby_name
from pgcarve.postgres import replication
from pgcarve.postgres.session import first_line
from pgcarve.virt.domain_xml import Disk, DomainSpec, InstanceMetadata, Nic, mac_for
from pgcarve.virt.storage import BaseImage

log = logging.getLogger("pgcarve.control.provisioning")

Readiness = Callable[[HostConfig, str, Progress, bool], Guest]
"""(host, guest name, progress, standby?) -> the guest once its PostgreSQL is ready for its role."""


class Provisioner:
    """Builds guests and instances for a fleet."""

    def __init__(self, fleet: Fleet, ready: Readiness | None = None):
        """`ready` replaces `wait_sql` as the wait for a new guest's PostgreSQL: a seam for
        stand-ins whose guests never boot (the benchmarks on libvirt's test driver)."""
        self.fleet = fleet
        self.ready: Readiness = ready if ready is not None else self.wait_sql

    # -- what a guest is ----------------------------------------------------------------------

    def domain_spec(self, host: HostConfig, name: str, meta: InstanceMetadata, image: BaseImage,
                    domain_type: str, creating: bool = False) -> DomainSpec:
        """The domain for guest `name` on `host`: its planned slot, its disks, its NIC."""
        plan, slot = self.fleet.placement.slot(host.name, meta.index)
        return DomainSpec(
            name=name,
            domain_type=domain_type,  # type: ignore[arg-type]
            metadata=meta,
            memory_mib=slot.memory_mib,
            vcpu_pins=slot.host_cpus,
            emulator_cpus=plan.emulator_cpus,
            numa_node=slot.numa_node,
            hugepages=self.fleet.config.instance.hugepages,
            kernel=image.kernel_path,
            initrd=image.initrd_path,
            disks=(Disk("vda", host.pool, f"{name}.qcow2"),
                   Disk("vdb", host.pool, f"{name}-seed.iso", format="raw", readonly=True)),
            nics=(Nic(host.network, mac_for(self.fleet.config.fleet, name)),),
            console_log=f"/var/log/libvirt/qemu/{name}-console.log",
            creating=creating,
        )

    def sync_names(self, standby_names: list[str]) -> str:
        """synchronous_standby_names for a primary whose standbys are these guests, in priority order."""
        repl = self.fleet.config.replication
        if not standby_names:
            return ""
        return replication.synchronous_standby_names(repl.sync_mode, min(repl.sync_count, len(standby_names)),
                                                     standby_names)

    def seed(self, name: str, instance: str, role: Role, secrets: InstanceSecrets,
             standby_names: list[str] | None = None, primary_host: str | None = None) -> GuestSeed:
        """The seed of guest `name` of `instance`: a certificate for both names from the fleet CA
        (clients verify with the CA; `verify-full` where they connect by one of these names)."""
        config = self.fleet.config
        ca = self.fleet.ca
        return GuestSeed(
            name=name, role=role, credentials=self.fleet.credentials,
            allowed_cidrs=tuple(config.allowed_cidrs), secrets=secrets,
            tls=ca.issue_server_certificate(list(dict.fromkeys([name, instance]))),
            ca_pem=ca.certificate_pem(),
            synchronous_commit=config.replication.synchronous_commit,
            synchronous_standby_names=self.sync_names(standby_names or []),
            primary_host=primary_host,
        )

    def primary_seed(self, name: str, standby_names: list[str]) -> GuestSeed:
        """The seed of a new instance's first primary (named as the instance); makes the
        instance's passwords if it has none yet."""
        return self.seed(name, name, "primary", self.fleet.secrets.load_or_create(name), standby_names)

    # -- one guest ---------------------------------------------------------------------------

    def create_guest(self, host: HostConfig, name: str, meta: InstanceMetadata, seed: GuestSeed,
                     progress: Progress) -> None:
        """Disk, seed and domain for a new guest, started (marked "creating")."""
        lv = self.fleet.hosts[host.name]
        image = self.fleet.images.on(host.name)
        require_free_space(self.fleet, host.name, self.fleet.config.instance.disk_reserve_mib)
        progress(name, f"disk and seed on {host.name}", 0.1)
        lv.storage.create_overlay(f"{name}.qcow2", image.disk, self.fleet.config.instance.disk_gib)
        with tempfile.TemporaryDirectory(prefix="pgcarve-") as tmp:
            iso = Path(tmp) / "seed.iso"
            write_seed_iso(seed, f"{name}-{int(time.time())}", iso)
            lv.storage.upload_file(f"{name}-seed.iso", iso)
        spec = self.domain_spec(host, name, meta, image, self.fleet.domain_types.of(host.name), creating=True)
        progress(name, f"starting on {host.name} CPUs {','.join(map(str, spec.vcpu_pins))}", 0.2)
        lv.define_and_start(spec)

    def wait_sql(self, host: HostConfig, name: str, progress: Progress, standby: bool = False) -> Guest:
        """Wait until PostgreSQL in the guest accepts our login (and, for a standby, is in recovery)."""
        lv = self.fleet.hosts[host.name]
        timeout_s = self.fleet.boot_timeout_s
        started = time.monotonic()
        deadline = started + timeout_s
        last_error = "no address yet"
        let_in = not standby  # a standby replicates only once its instance's guests let its address in
        while time.monotonic() < deadline:
            info = lv.guest(name)
            if info.state == "paused":
                errors = lv.disk_errors(name)
                if "no space left" in errors.values():
                    raise CapacityError(
                        f"{name} on {host.name}: its disk ran out of space while booting (storage pool "
                        f"{lv.storage.pool_name} at {lv.storage.pool_path} is full); free space there or lower "
                        "instance.disk_gib"
                    )
                if errors:
                    raise GuestNotReady(f"{name} on {host.name} stopped on a disk error: {errors}")
            if info.state not in ("running", "paused"):
                raise GuestNotReady(f"{name} on {host.name} stopped while booting (state {info.state})")
            guest = self.fleet.reach(info)
            if not let_in and guest.address is not None:
                try:
                    refresh_replication_access(self.fleet, info.metadata.index)
                    let_in = True
                except PgcarveError as exc:
                    last_error = f"letting it replicate: {exc}"
            if guest.endpoint is not None:
                try:
                    with self.fleet.connect(guest, timeout_s=3) as conn:
                        if replication.in_recovery(conn) == standby:
                            return guest
                        last_error = "not in the expected role yet"
                except psycopg.Error as exc:
                    last_error = first_line(exc)
            elapsed = time.monotonic() - started
            progress(name, "booting" if guest.endpoint is None else "waiting for PostgreSQL",
                     min(0.9, 0.25 + 0.65 * elapsed / 60))
            time.sleep(0.5)
        raise GuestNotReady(f"{name} on {host.name} did not accept SQL within {timeout_s:.0f} s: {last_error}")

    # -- instances ---------------------------------------------------------------------------

    def create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        """Create instance `index`: its primary, then its standbys cloned from it, and wait
        until the primary accepts SQL and every standby streams from it.

        On any failure the instance's guests and disks are removed again, so a failed
        scale-up leaves nothing half-made (the instance held no acknowledged data yet).
        """
        with self.fleet.locks.exclusive(index, "creating"):
            try:
                instance = self._create_instance(index, progress)
            except BaseException:
                discard_instance(self.fleet, index)
                raise
            for guest in instance.guests:
                self.fleet.hosts[guest.info.host].mark_complete(guest.name)
            return instance

    def _create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        fleet_name = self.fleet.config.fleet
        name = instance_name(fleet_name, index)
        primary_host, standby_hosts = self.fleet.placement.hosts_for(index)
        standby_names = [standby_name(fleet_name, index, s) for s in range(1, len(standby_hosts) + 1)]
        meta = InstanceMetadata(fleet=fleet_name, cluster=name, role="primary", index=index)
        self.create_guest(primary_host, name, meta, self.primary_seed(name, standby_names), progress)
        primary = self.ready(primary_host, name, progress, False)
        progress(name, "primary accepts SQL", 1.0 if not standby_names else 0.6)
        if not standby_names:
            return self.fleet.instance(name)
        with ThreadPoolExecutor(max_workers=len(standby_names)) as pool:
            futures = [pool.submit(self.create_standby, primary, host, sname, s, progress)
                       for s, (sname, host) in enumerate(zip(standby_names, standby_hosts, strict=True), start=1)]
            for future in futures:
                future.result()
        self.wait_streaming(primary, standby_names, progress)
        try:  # every guest learns every other's address, so a standby is ready to be promoted
            refresh_replication_access(self.fleet, index)
        except PgcarveError as exc:  # the primary and its standbys are whole: not a reason to fail
            log.warning("%s: standbys not yet told each other's addresses (%s); a later refresh will", name, exc)
        progress(name, "ready", 1.0)
        return self.fleet.instance(name)

    def create_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                       progress: Progress = no_progress) -> Guest:
        """A new standby guest `name` on `host`, cloned (pg_basebackup) from `primary` through a
        physical slot of its own; returns once it replays in recovery."""
        if primary.address is None:
            raise GuestNotReady(f"{primary.name} has no address to clone a standby from")
        with self.fleet.connect(primary) as conn:
            replication.create_slot(conn, slot_name(name))
        meta = primary.info.metadata
        smeta = InstanceMetadata(fleet=meta.fleet, cluster=meta.cluster, role="standby", index=meta.index,
                                 standby=number)
        seed = self.seed(name, meta.cluster, "standby", self.fleet.instance_secrets(meta.cluster),
                         primary_host=primary.address)
        self.create_guest(host, name, smeta, seed, progress)
        guest = self.ready(host, name, progress, True)
        progress(name, "standby replaying", 1.0)
        return guest

    def wait_streaming(self, primary: Guest, standbys: list[str], progress: Progress,
                       timeout_s: float = 300) -> None:
        """Until every one of `standbys` streams from `primary`."""
        wanted = {application_name(s) for s in standbys}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.fleet.connect(primary) as conn:
                if wanted <= replication.streaming_standbys(conn):
                    return
            progress(primary.name, "waiting for standbys to stream", 0.9)
            time.sleep(0.5)
        raise GuestNotReady(f"standbys of {primary.name} ({', '.join(sorted(wanted))}) are not streaming "
                            f"after {timeout_s:.0f} s")
