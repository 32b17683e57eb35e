"""Creating instances: a primary, and its standbys cloned from it on other hosts.

Each guest boots from a qcow2 overlay of the image and a NoCloud seed, pinned to its planned
slot, marked "creating" in its libvirt metadata until its whole instance is built (so a manager
killed half-way knows what it never finished: control/removal.py). A seed carries the guest's
certificate from the fleet CA and its instance's own passwords (made with the primary's seed).

The standbys of a new instance boot while their primary does: the primary's address is reserved
on its host's network before it starts (virt/dhcp.py), so they start with it, their seeds naming
it. Their data directory is the image's, the very one the new primary starts from, so none is
copied: each streams from the primary's first WAL record once the primary accepts SQL, holds the
standby's slot and lets its address in (control/access.py). A standby added to an instance that
already has data clones it (its guest retries pg_basebackup until the primary lets it in).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psycopg

from pgcarve.backup import pgbackrest
from pgcarve.config import HostConfig
from pgcarve.control.access import refresh_replication_access
from pgcarve.control.boot_watch import REBUILDING, Boot, started, wait_sql
from pgcarve.control.capacity import require_free_space
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.removal import after_failed_create, remove_guest
from pgcarve.control.roles_guard import configured_roles
from pgcarve.control.sync import initial_record, names_for
from pgcarve.control.sync_record import SyncRecord
from pgcarve.errors import GuestNotReady, GuestStuck, PgcarveError
from pgcarve.failpoints import failpoint
from pgcarve.guest.credentials import InstanceSecrets
from pgcarve.guest.image import LocalImage
from pgcarve.guest.seed import GuestSeed, Role, patroni_seed, write_seed_iso
from pgcarve.naming import application_name, disk_volume, instance_name, seed_volume, slot_name, standby_name
from pgcarve.postgres import replication
from pgcarve.postgres.session import first_line
from pgcarve.virt.domain_xml import Disk, DomainSpec, InstanceMetadata, Nic, mac_for
from pgcarve.virt.storage import BaseImage

log = logging.getLogger(__name__)
SLOT_TIMEOUT_S = 120.0  # how long a busy primary is asked again for a new standby's slot

Readiness = Callable[[HostConfig, str, Progress, bool | None], Guest]
"""(host, guest name, progress, standby? (None: whichever role Patroni gives it)) -> the guest once its
PostgreSQL is ready for that role."""


class Provisioner:
    """Builds guests and instances for a fleet."""

    def __init__(self, fleet: Fleet, ready: Readiness | None = None):
        """`ready` replaces `wait_sql` as the wait for a new guest's PostgreSQL: a seam for
        stand-ins whose guests never boot (the benchmarks on libvirt's test driver)."""
        self.fleet = fleet
        self.ready: Readiness = ready if ready is not None else self.wait_sql
        self._made: dict[str, tuple[InstanceMetadata, GuestSeed]] = {}  # created here, not yet ready
        # Their consoles, opened as they started, for the boot watch; not for stand-ins that never boot.
        self._booting: dict[str, Boot] | None = {} if ready is None else None

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
            disks=(Disk("vda", host.pool, disk_volume(name)),
                   Disk("vdb", host.pool, seed_volume(name), format="raw", readonly=True)),
            nics=(Nic(host.network, mac_for(self.fleet.config.fleet, name)),),
            console_log=f"/var/log/libvirt/qemu/{name}-console.log",
            creating=creating,
        )

    def seed(self, name: str, instance: str, role: Role, secrets: InstanceSecrets, sync_names: str = "",
             primary_host: str | None = None, rejoin: bool = False) -> GuestSeed:
        """The seed of guest `name` of `instance`: a certificate for both names from the fleet CA
        (clients verify with the CA; `verify-full` where they connect by one of these names)."""
        config = self.fleet.config
        ca = self.fleet.ca
        patroni = patroni_seed(config, instance, secrets)
        backup = None
        if config.backup is not None:
            major = LocalImage(self.fleet.images.image_dir).versions().get("postgresql_major", "")
            backup = pgbackrest.seed_document(config.backup, instance, major)
        return GuestSeed(
            name=name, role=role, credentials=self.fleet.credentials,
            allowed_cidrs=tuple(config.allowed_cidrs), secrets=secrets,
            # Under Patroni the same certificate is the guest's etcd client certificate too.
            tls=ca.issue_certificate(dns_names=list(dict.fromkeys([name, instance])), client=patroni is not None),
            patroni=patroni,
            backup=backup,
            ca_pem=ca.certificate_pem(),
            synchronous_commit=config.replication.synchronous_commit,
            synchronous_standby_names=sync_names,
            primary_host=primary_host,
            rejoin=rejoin,
            fence_after_s=config.recovery.fence_after_s,
            clusters=config.instance.clusters,  # a standby clones each of its primary's clusters
        )

    def primary_seed(self, name: str, record: SyncRecord | None) -> GuestSeed:
        """The seed of a new instance's first primary (named as the instance), whose synchronous
        standbys are the record's (none: no record); makes the instance's passwords if it has
        none yet."""
        return self.seed(name, name, "primary", self.fleet.secrets.load_or_create(name),
                         names_for(record) if record is not None else "")

    def standby_seed(self, name: str, primary: Guest, rejoin: bool = False, from_image: bool = False) -> GuestSeed:
        """The seed of a standby of `primary`; `rejoin`: its disk holds a former primary to rewind;
        `from_image`: the primary is new, made from the same image, so the standby streams from
        its image's own data directory instead of cloning."""
        if primary.address is None:
            raise GuestNotReady(f"{primary.name} has no address for {name} to replicate from")
        instance = primary.info.metadata.cluster
        return replace(self.seed(name, instance, "standby", self.fleet.instance_secrets(instance),
                                 primary_host=primary.address, rejoin=rejoin), from_image=from_image)

    def write_seed(self, host: HostConfig, name: str, seed: GuestSeed) -> None:
        """Upload the guest's NoCloud seed volume (read at its next boot)."""
        with tempfile.TemporaryDirectory(prefix="pgcarve-") as tmp:
            iso = Path(tmp) / "seed.iso"
            # A new instance-id each time: the guest tells a new seed from one it has acted on.
            write_seed_iso(seed, f"{name}-{time.time_ns()}", iso)
            self.fleet.hosts[host.name].storage.upload_file(seed_volume(name), iso)

    # -- one guest ---------------------------------------------------------------------------

    def create_guest(self, host: HostConfig, name: str, meta: InstanceMetadata, seed: GuestSeed,
                     progress: Progress) -> None:
        """Disk, seed and domain for a new guest, started (marked "creating")."""
        lv = self.fleet.hosts[host.name]
        image = self.fleet.images.on(host.name)
        require_free_space(self.fleet, host.name, self.fleet.config.instance.disk_reserve_mib)
        progress(name, f"disk and seed on {host.name}", 0.1)
        lv.storage.create_overlay(disk_volume(name), image.disk, self.fleet.config.instance.disk_gib)
        self.write_seed(host, name, seed)
        spec = self.domain_spec(host, name, meta, image, self.fleet.domain_types.of(host.name), creating=True)
        progress(name, f"starting on {host.name} CPUs {','.join(map(str, spec.vcpu_pins))}", 0.2)
        lv.define_and_start(spec)
        self._made[name] = (meta, seed)
        if self._booting is not None:
            self._booting[name] = started(lv, name)

    def boot_kept_disk(self, host_name: str, name: str, meta: InstanceMetadata, image_tag: str,
                       start: bool = True) -> None:
        """Define guest `name` again on the disk and seed it left behind (a retired instance
        coming back: control/retirement.py), in its planned slot with its MAC, booting the image
        version its disk was made from; start it unless told not to."""
        host = self.fleet.config.host(host_name)
        lv = self.fleet.hosts[host_name]
        seed = seed_volume(name)
        if seed not in lv.storage.volume_names():
            raise GuestNotReady(f"{name} on {host_name}: its seed volume {seed} is gone; it cannot boot as it was")
        image = lv.storage.uploaded_image(image_tag) if image_tag else None
        if image is None:
            image = self.fleet.images.on(host_name)
            log.warning("%s: image version %s is no longer on %s; booting its disk with the current kernel",
                        name, image_tag or "(unknown)", host_name)
        spec = self.domain_spec(host, name, meta, image, self.fleet.domain_types.of(host_name))
        if start:
            lv.define_and_start(spec)
        else:
            lv.define(spec)

    def wait_sql(self, host: HostConfig, name: str, progress: Progress, standby: bool | None = False) -> Guest:
        """Wait until PostgreSQL in the guest accepts our login (and, for a standby, is in recovery;
        `standby` None: in whichever role Patroni gives it), its boot watched stage by stage."""
        boot = self._booting.pop(name, None) if self._booting is not None else None
        return wait_sql(self.fleet, host, name, progress, standby, boot)

    def ready_once_rebuilt(self, host: HostConfig, name: str, progress: Progress, standby: bool | None) -> Guest:
        """`ready` for a guest this provisioner just created: one stuck in its first boot, before
        it held any data, is destroyed and created again once (a new seed, the same name and slot);
        a second stuck boot fails with both diagnoses."""
        try:
            guest = self.ready(host, name, progress, standby)
        except GuestStuck as first:
            made = self._made.pop(name, None)
            if made is None:
                raise
            log.warning("%s; building %s again, once", first, name)
            progress(name, f"{REBUILDING}{first}", 0.2)
            remove_guest(self.fleet, self.fleet.hosts[host.name].guest(name), keep_address=True)
            self.create_guest(host, name, *made, progress)
            self._made.pop(name, None)
            try:
                return self.ready(host, name, progress, standby)
            except GuestStuck as second:
                raise GuestStuck(f"{name} on {host.name} did not boot, twice. First: {first} Then, built again: "
                                 f"{second}", second.stage) from second
        self._made.pop(name, None)
        return guest

    # -- instances ---------------------------------------------------------------------------

    def create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        """Create instance `index`: its primary, and its standbys booting meanwhile, cloned from
        it once it answers; wait until the primary accepts SQL and every standby streams from it.

        The primary loses its "creating" mark before any standby can clone from it (a standby's
        slot is made only after, and so is its replication access): from then on it could
        acknowledge a commit, so a restarted manager never discards it as half-made
        (control/removal.py). A failure here removes the whole instance only while it could not
        have acknowledged a commit; otherwise the instance stays and only its unfinished standbys
        go (the HA loop builds them again).
        """
        with self.fleet.locks.exclusive(index, "creating"):
            replaying: set[str] = set()
            try:
                instance = self._create_instance(index, progress, replaying)
            except BaseException as exc:
                after_failed_create(self.fleet, index, exc, replaying)
                raise
            for guest in instance.standbys:
                self.fleet.hosts[guest.info.host].mark_complete(guest.name)
            return instance

    def _create_instance(self, index: int, progress: Progress, replaying: set[str]) -> Instance:
        fleet_name = self.fleet.config.fleet
        name = instance_name(fleet_name, index)
        primary_host, standby_hosts = self.fleet.placement.hosts_for(index)
        standby_names = [standby_name(fleet_name, index, s) for s in range(1, len(standby_hosts) + 1)]
        meta = InstanceMetadata(fleet=fleet_name, cluster=name, role="primary", index=index,
                                roles=configured_roles(self.fleet.config))
        if self.fleet.patroni is not None:
            # Keys an earlier instance of this name left would make the new primary wait for a
            # leader that is gone instead of bootstrapping.
            self.fleet.patroni.forget(name)
            record = None
        else:
            # The synchronous set is recorded before the primary exists (control/sync_record.py).
            record = initial_record(name, name, primary_host.name, standby_names, self.fleet.config.replication)
            if record is not None:
                self.fleet.sync_records.put(record)
        standbys = list(enumerate(zip(standby_names, standby_hosts, strict=True), start=1))
        reserved = self.reserve_address(primary_host, name) if standbys else None
        self.create_guest(primary_host, name, meta, self.primary_seed(name, record), progress)
        booting: dict[str, str] = {}  # standby -> the primary address its seed names
        if reserved is not None:
            addressed: Guest | None = Guest(info=self.fleet.hosts[primary_host.name].guest(name), address=reserved,
                                            endpoint=None)
            progress(name, f"booting at {reserved} (reserved); its standbys start", 0.25)
        elif standbys and self.fleet.hosts[primary_host.name].guest_address(
                name, primary_host.network, mac_for(fleet_name, name)) is None:
            addressed = self.wait_address(primary_host, name, progress)
        else:
            # A name used before (purged, discarded) may still have its old DHCP lease listed, and
            # the new guest may get another address: then the standbys wait until the primary
            # answers at its own address, as they would have to be built again otherwise.
            addressed = None
        for number, (sname, host) in standbys:
            if addressed is not None:  # they boot while the primary does, and stream once it answers
                self.start_standby(addressed, host, sname, number, progress, self.same_image(primary_host, host))
                booting[sname] = str(addressed.address)
        primary = self.ready_once_rebuilt(primary_host, name, progress, False)
        self.fleet.hosts[primary_host.name].mark_complete(name)
        failpoint("provisioning.primary_ready")
        progress(name, "primary accepts SQL", 1.0 if not standby_names else 0.6)
        built = [(primary_host.name, name), *((host.name, sname) for _n, (sname, host) in standbys)]  # read alone
        if not standby_names:
            return self.fleet.instance_on(index, built)
        with ThreadPoolExecutor(max_workers=len(standby_names)) as pool:
            futures = {sname: pool.submit(self.finish_standby, primary, host, sname, number, booting[sname], progress)
                       if sname in booting else pool.submit(self.create_standby, primary, host, sname, number, progress,
                                                            self.same_image(primary_host, host))
                       for number, (sname, host) in standbys}
            for sname, future in futures.items():
                future.result()
                replaying.add(sname)
                failpoint("provisioning.standby_replaying")
        self.wait_streaming(primary, standby_names, progress)
        try:  # every guest learns every other's address, so a standby is ready to be promoted
            refresh_replication_access(self.fleet, index)
        except PgcarveError as exc:  # the primary and its standbys are whole: not a reason to fail
            log.warning("%s: standbys not yet told each other's addresses (%s); a later refresh will", name, exc)
        progress(name, "ready", 1.0)
        return self.fleet.instance_on(index, built)

    def create_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                       progress: Progress = no_progress, from_image: bool = False) -> Guest:
        """A new standby guest `name` on `host` for a primary that answers: cloned
        (pg_basebackup) from `primary` through a physical slot of its own (or, `from_image`, for
        a primary just made from the same image: streaming from its first record); returns once
        it replays in recovery."""
        if primary.address is None:
            raise GuestNotReady(f"{primary.name} has no address to clone a standby from")
        self.make_slot(primary, name)
        self.start_standby(primary, host, name, number, progress, from_image)
        guest = self.ready_once_rebuilt(host, name, progress, True)
        progress(name, "standby replaying", 1.0)
        return guest

    def make_slot(self, primary: Guest, standby: str, timeout_s: float = SLOT_TIMEOUT_S) -> None:
        """Standby `standby`'s replication slot on `primary`, asked again while the primary is
        too busy to answer (under emulation, booting guests and clones beside it can hold a
        connection past its timeout). Making the slot twice is harmless: it is made if missing."""
        if self.fleet.patroni is not None:
            return  # Patroni makes a slot on the leader for every member (use_slots)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.fleet.connect(primary) as conn:
                    replication.create_slot(conn, slot_name(standby))
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise GuestNotReady(f"{primary.name} did not answer for {timeout_s:.0f} s to make the "
                                        f"replication slot of {standby} (last: {first_line(exc)})") from exc
                log.info("%s: not answering yet to make %s's slot (%s); asking again", primary.name, standby,
                         first_line(exc))
                time.sleep(1)

    def start_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                      progress: Progress = no_progress, from_image: bool = False) -> None:
        """Disk, seed and domain of standby `name`, started: its seed names `primary`'s address,
        which need not answer yet (the guest retries until it can)."""
        meta = primary.info.metadata
        # Its seed is made under the fleet's decider of roles (an instance made under the other one
        # gets no new guest: control/roles_guard.py).
        smeta = InstanceMetadata(fleet=meta.fleet, cluster=meta.cluster, role="standby", index=meta.index,
                                 standby=number, roles=configured_roles(self.fleet.config))
        self.create_guest(host, name, smeta, self.standby_seed(name, primary, from_image=from_image), progress)
        progress(name, f"booting; {'streams' if from_image else 'clones'} once {primary.name} answers", 0.25)

    def same_image(self, primary_host: HostConfig, standby_host: HostConfig) -> bool:
        """Whether a standby on `standby_host` boots the very image a new primary on
        `primary_host` does (then it can start from its own copy of the image's data directory):
        volume names carry the build's tag (image.tag), so equal names mean the same build."""
        return self.fleet.images.on(primary_host.name).disk == self.fleet.images.on(standby_host.name).disk

    def reserve_address(self, host: HostConfig, name: str) -> str | None:
        """A fixed address for new guest `name` on its host's network, before it boots; None
        (the guest takes whatever DHCP gives) when the network cannot hold one."""
        try:
            return self.fleet.hosts[host.name].reserve_address(host.network, mac_for(self.fleet.config.fleet, name))
        except PgcarveError as exc:
            log.warning("%s: no fixed address on network %s of %s (%s); its standbys start once it has one",
                        name, host.network, host.name, exc)
            return None

    def finish_standby(self, primary: Guest, host: HostConfig, name: str, number: int, seeded_address: str,
                       progress: Progress = no_progress) -> Guest:
        """Standby `name`, started by `start_standby` with `seeded_address` for its primary,
        now that `primary` answers: make its slot and wait until it replays. If the primary
        answered at another address than the one seeded (a stale DHCP lease seen first), the
        standby is built again the ordinary way."""
        if primary.address != seeded_address:
            log.warning("%s: its seed named %s for %s, which answers at %s: building it again", name,
                        seeded_address, primary.name, primary.address)
            remove_guest(self.fleet, self.fleet.hosts[host.name].guest(name))
            return self.create_standby(primary, host, name, number, progress, self.same_image(
                self.fleet.config.host(primary.info.host), host))
        self.make_slot(primary, name)
        guest = self.ready_once_rebuilt(host, name, progress, True)
        progress(name, "standby replaying", 1.0)
        return guest

    def wait_address(self, host: HostConfig, name: str, progress: Progress) -> Guest:
        """Guest `name` once it has an address (its DHCP lease), well before its PostgreSQL answers."""
        lv = self.fleet.hosts[host.name]
        deadline = time.monotonic() + self.fleet.boot_timeout_s
        while time.monotonic() < deadline:
            info = lv.guest(name)
            if info.state not in ("running", "paused"):
                raise GuestNotReady(f"{name} on {host.name} stopped while booting (state {info.state})")
            guest = self.fleet.reach(info)
            if guest.address is not None:
                progress(name, f"booting at {guest.address}; its standbys start", 0.25)
                return guest
            progress(name, "booting", 0.22)
            time.sleep(0.5)
        raise GuestNotReady(f"{name} on {host.name} got no address within {self.fleet.boot_timeout_s:.0f} s")

    def rejoin(self, guest: Guest, primary: Guest, number: int, progress: Progress = no_progress) -> Guest:
        """Turn a former primary of the instance (fenced or lost in a failover) into standby
        `number` of `primary`, keeping its disk: powered off, given a standby seed that asks for a
        rewind (pg_rewind onto the new primary; if that fails, its data directory is kept aside
        in the guest and a fresh copy cloned), and started again."""
        host = self.fleet.config.host(guest.info.host)
        lv = self.fleet.hosts[host.name]
        self.fleet.planned_stops.will_stop(guest.name)
        lv.stop(guest.name)
        progress(guest.name, f"rejoining as a standby of {primary.name} (rewind)", 0.2)
        self.make_slot(primary, guest.name)
        self.write_seed(host, guest.name, self.standby_seed(guest.name, primary, rejoin=True))
        # Metadata last: until now it still said primary, so a restart never started it as a standby
        # with its old seed, nor as a primary (the recorded primary is another guest).
        lv.set_metadata(guest.name, replace(guest.info.metadata, role="standby", standby=number))
        lv.start(guest.name)
        return self.wait_sql(host, guest.name, progress, standby=True)

    def wait_streaming(self, primary: Guest, standbys: list[str], progress: Progress,
                       timeout_s: float = 300, renew_lease: bool = False) -> None:
        """Until every one of `standbys` streams from `primary`; `renew_lease`: keep the manager's
        lease fresh meanwhile (a primary whose watchdog saw the manager before must not fence
        itself while its standbys boot)."""
        wanted = {application_name(s) for s in standbys}
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            try:
                with self.fleet.connect(primary) as conn:
                    if renew_lease:
                        replication.renew_manager_lease(conn)
                    streaming = replication.streaming_standbys(conn)
                if wanted <= streaming:
                    return
                last = f"streaming now: {', '.join(sorted(streaming & wanted)) or 'none'}"
            except psycopg.Error as exc:  # a primary busy with its standbys' clones may answer late: ask again
                last = first_line(exc)
            progress(primary.name, "waiting for standbys to stream", 0.9)
            time.sleep(0.5)
        raise GuestNotReady(f"standbys of {primary.name} ({', '.join(sorted(wanted))}) are not streaming "
                            f"after {timeout_s:.0f} s (last: {last})")
