"""Scale-down retires instances, scale-up brings them back, and only purge deletes their data.

Each instance is a database of its own, so scaling down never deletes one. Retiring an instance
fences its writes, waits for its synchronous standby to replay everything, then stops and
undefines its guests (their CPUs are free again) but keeps every disk, with a marker volume
beside each (control/retired.py). Scaling up re-creates instance i from its own disks before anything new (same
database, same system identifier, standbys catching up through their slots). Deleting the data
takes an explicit purge by name (DELETE /v1/instances/{name}?confirm={name}, `pgcarve purge`).

Every step leaves something a restarted manager can finish: markers are written before any
guest stops and deleted only after a revived instance is whole; `finish_interrupted` completes
a retirement (or re-retires a revival) that a killed manager left half-way.

Under Patroni (replication.roles: patroni) retiring is the same fence, catch-up and stop, and the
instance's keys stay in etcd: they say who may lead when it comes back (a member of its last
synchronous set) and that its data exists (no member bootstraps a new database). Bringing it back
boots every member from its disk and lets Patroni give the roles. Purge removes the keys too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import psycopg

from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.removal import forget_patroni_keys
from pgcarve.control.retired import RetiredGuest, RetiredInstance, retired_instance, retired_instances
from pgcarve.control.roles_guard import refuse
from pgcarve.errors import Conflict, GuestNotReady, NotFound, PgcarveError
from pgcarve.naming import application_name, disk_volume, index_of, seed_volume, slot_name
from pgcarve.postgres import replication
from pgcarve.postgres.session import first_line
from pgcarve.virt.storage import image_tag_of

log = logging.getLogger(__name__)

FENCE_REASON = "scale-down"


# -- retiring -------------------------------------------------------------------------------------

def retire_instance(fleet: Fleet, instance: Instance, progress: Progress = no_progress,
                    timeout_s: float = 120) -> RetiredInstance:
    """Retire a running instance without losing an acknowledged commit, keeping all its disks.

    New writes are refused first (read-only default, client sessions ended), then we wait until
    a synchronous standby has replayed the primary's last WAL position. If that does not happen
    within `timeout_s` the fence is lifted again and the instance stays as it was. An instance made
    under another decider of roles than the fleet's is refused (RolesMismatch), nothing changed.
    """
    refuse(instance.roles_mismatch)
    with fleet.locks.exclusive(instance.index, "retiring"):
        if fleet.patroni is not None and instance.primary is None:
            raise GuestNotReady(f"{instance.name} has no leader now ({_why_no_leader(fleet)}): retiring needs one, "
                                "to refuse new writes and see a synchronous standby hold them all; nothing was changed")
        fence_and_catch_up(fleet, instance, progress, timeout_s)
        return _retire(fleet, instance, progress)


def fence_and_catch_up(fleet: Fleet, instance: Instance, progress: Progress, timeout_s: float) -> None:
    primary = instance.primary
    if primary is None or primary.info.state != "running" or not instance.standbys:
        return
    standbys = [s.name for s in instance.standbys]
    progress(instance.name, "refusing new writes", 0.2)
    try:
        with fleet.connect(primary) as conn:
            lsn = replication.refuse_writes(conn, FENCE_REASON)
            progress(instance.name, "waiting for a synchronous standby to replay everything", 0.4)
            deadline = time.monotonic() + timeout_s
            while not replication.synchronous_standbys_at(conn, standbys, lsn):
                if time.monotonic() > deadline:
                    replication.allow_writes(conn)
                    raise GuestNotReady(
                        f"{instance.name}: no synchronous standby replayed up to {lsn} within {timeout_s:.0f} s; "
                        "the instance was not retired and accepts writes again")
                time.sleep(0.2)
    except psycopg.Error as exc:
        _lift_fence(fleet, primary)
        raise GuestNotReady(f"{instance.name}: could not fence writes before retiring it: {first_line(exc)}; "
                            "the instance was not retired") from None


def _lift_fence(fleet: Fleet, primary: Guest) -> None:
    """Best effort after a failed fence; the primary watch lifts a fence left behind as well."""
    try:
        _allow_writes(fleet, primary)
    except psycopg.Error as exc:
        log.warning("%s: could not lift the write fence yet (%s); the primary watch retries", primary.name,
                    first_line(exc))


def _retire(fleet: Fleet, instance: Instance, progress: Progress) -> RetiredInstance:
    at = time.time()
    guests = [*instance.standbys, *instance.stale, *((instance.primary,) if instance.primary else ())]
    retired = []
    # Markers first: from here on a restarted manager finishes the retirement (finish_interrupted).
    for guest in guests:
        meta = guest.info.metadata
        rg = RetiredGuest(name=guest.name, host=guest.info.host, index=meta.index, role=meta.role,
                          standby=meta.standby, retired_at=at, image_tag=image_tag_of(guest.info.kernel) or "",
                          disk_mib=0, roles=meta.roles)
        fleet.hosts[rg.host].storage.create_marker(rg.marker)
        retired.append(rg)
    progress(instance.name, "stopping guests (disks kept)", 0.8)
    for guest in guests:
        _undefine_keeping_disks(fleet, guest.info.host, guest.name)
    progress(instance.name, "retired (disks kept)", 1.0)
    log.info("retired %s: guests %s stopped and undefined, disks kept", instance.name,
             ", ".join(f"{g.name} on {g.host}" for g in retired))
    return RetiredInstance(name=instance.name, index=instance.index, guests=tuple(retired))


def _undefine_keeping_disks(fleet: Fleet, host: str, guest: str) -> None:
    fleet.planned_stops.will_stop(guest)
    fleet.hosts[host].destroy(guest)  # power off and undefine; volumes are left alone
    fleet.forwards.remove(guest)


# -- bringing back --------------------------------------------------------------------------------

def revive_instance(provisioner: Provisioner, retired: RetiredInstance, progress: Progress = no_progress) -> Instance:
    """Boot a retired instance from its own disks: the same guests, slots and metadata, all at
    once; lift the retirement's fence once its standbys stream, then drop the markers. A former
    primary that a failover had replaced (stale) is defined but left off: the HA loop rejoins it.
    One retired under another decider of roles than the fleet's is refused (RolesMismatch)."""
    fleet = provisioner.fleet
    refuse(retired.roles_mismatch)
    with fleet.locks.exclusive(retired.index, "reviving"):
        if fleet.patroni is not None:
            _check_disks_kept(fleet, retired)
            return _undone_on_failure(fleet, retired, lambda: _revive_under_patroni(provisioner, retired, progress))
        record = fleet.sync_records.get(retired.name)
        primary_name = record.primary if record is not None else next(
            (g.name for g in retired.guests if g.role == "primary"), None)
        by_name = {g.name: g for g in retired.guests}
        if primary_name not in by_name:
            raise GuestNotReady(f"{retired.name}: its primary {primary_name or '(unknown)'} is not among its "
                                f"retired guests ({', '.join(by_name)}); purge it to make its slot new")
        _check_disks_kept(fleet, retired)
        return _undone_on_failure(fleet, retired, lambda: _revive(provisioner, retired, by_name[primary_name],
                                                                  progress))


def _check_disks_kept(fleet: Fleet, retired: RetiredInstance) -> None:
    missing = [g.name for g in retired.guests
               if disk_volume(g.name) not in fleet.hosts[g.host].storage.volume_names()]
    if missing:
        raise GuestNotReady(f"{retired.name}: the kept disks of {', '.join(missing)} are gone; "
                            f"purge it (`pgcarve purge {retired.name}`) to make its slot new")


def _undone_on_failure(fleet: Fleet, retired: RetiredInstance, revive: Callable[[], Instance]) -> Instance:
    try:
        return revive()
    except BaseException:
        # Retired again as it was: markers and disks untouched, guests undefined.
        _retire_again(fleet, retired)
        raise


def _retire_again(fleet: Fleet, retired: RetiredInstance) -> list[str]:
    """Undefine whatever runs of a retired instance (a revival cut short), keeping every disk;
    returns the guests undefined. If a primary answers, its writes are fenced and a synchronous
    standby caught up first, as in a retirement: the revival may have lifted the fence and
    acknowledged commits, and guests powered off together keep only what reached their disks."""
    left = [g for g in retired.guests if fleet.hosts[g.host].defined(g.name)]
    if not left:
        return []
    inst = fleet.instance_at(retired.index)
    if inst is not None and inst.primary is not None and inst.primary.info.state == "running":
        try:
            fence_and_catch_up(fleet, inst, no_progress, fleet.config.replication.retire_catch_up_s)
        except PgcarveError as exc:
            log.warning("%s: retiring it again without a caught-up synchronous standby (%s); its primary's disk "
                        "holds every acknowledged commit", retired.name, exc)
    for guest in left:
        _undefine_keeping_disks(fleet, guest.host, guest.name)
    return [g.name for g in left]


def _revive(provisioner: Provisioner, retired: RetiredInstance, primary_guest: RetiredGuest,
            progress: Progress) -> Instance:
    fleet = provisioner.fleet
    primary_name = primary_guest.name
    booting = [g for g in retired.guests if g.name == primary_name or g.role == "standby"]
    for guest in retired.guests:
        start = guest in booting
        progress(guest.name, f"{'starting' if start else 'defining'} from its kept disk on {guest.host}", 0.1)
        provisioner.boot_kept_disk(guest.host, guest.name, guest.metadata(fleet.config.fleet), guest.image_tag,
                                   start=start)
    primary = provisioner.ready(fleet.config.host(primary_guest.host), primary_name, progress, False)
    standby_guests = [g for g in booting if g.name != primary_name]
    with ThreadPoolExecutor(max_workers=max(1, len(standby_guests))) as pool:
        futures = [pool.submit(provisioner.ready, fleet.config.host(g.host), g.name, progress, True)
                   for g in standby_guests]
        while not all(f.done() for f in futures):
            try:
                with fleet.connect(primary) as conn:
                    replication.renew_manager_lease(conn)  # its watchdog saw us before: we are back
            except psycopg.Error as exc:  # busy with its standbys' start: the next round renews it
                log.info("%s: lease not renewed this round (%s)", retired.name, first_line(exc))
            wait(futures, timeout=1.0)
        standbys = [f.result() for f in futures]
    if standbys:  # (without standbys, retiring fenced nothing)
        _follow_if_needed(fleet, primary, standbys)
        provisioner.wait_streaming(primary, [g.name for g in standbys], progress, renew_lease=True)
        with fleet.connect(primary) as conn:
            replication.allow_writes(conn)
    for guest in retired.guests:
        fleet.hosts[guest.host].storage.delete_volume(guest.marker)
    progress(retired.name, "back from retirement", 1.0)
    log.info("brought %s back from retirement (retired %s): %s", retired.name,
             time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(retired.retired_at)),
             ", ".join(f"{g.name} on {g.host}" for g in retired.guests))
    return fleet.instance(retired.name)


def _revive_under_patroni(provisioner: Provisioner, retired: RetiredInstance, progress: Progress) -> Instance:
    """Boot every member from its kept disk at once; Patroni, from the keys the instance kept in
    etcd, lets only a member of its last synchronous set take the lead, and the others follow.

    The retirement's fence is in the former leader's own settings (postgresql.auto.conf). It is
    lifted as soon as a member leads, before its replicas stream: a replica asks its leader for a
    read-write session before following it onto a new timeline, and a fenced leader refuses that.
    Lifting it early loses nothing: in strict synchronous mode no commit is acknowledged before a
    standby streams. It is lifted on every member at the end (a former leader that came back as
    a replica would otherwise refuse writes the day it is promoted)."""
    fleet = provisioner.fleet
    for guest in retired.guests:
        progress(guest.name, f"starting from its kept disk on {guest.host}", 0.1)
        provisioner.boot_kept_disk(guest.host, guest.name, guest.metadata(fleet.config.fleet), guest.image_tag)
    by_name = {g.name: g for g in retired.guests}
    with ThreadPoolExecutor(max_workers=len(retired.guests)) as pool:
        answering = {g.name: pool.submit(provisioner.ready, fleet.config.host(g.host), g.name, progress, None)
                     for g in retired.guests}
        leader = _wait_for_leader(fleet, retired, answering, progress)
        _allow_writes(fleet, leader)
        members = {name: future.result() for name, future in answering.items()}
    others = [name for name in by_name if name != leader.name]
    progress(retired.name, f"{leader.name} leads; waiting for {', '.join(others)} to stream from it", 0.8)
    if others:
        provisioner.wait_streaming(leader, others, progress, timeout_s=max(300.0, fleet.boot_timeout_s))
    for name in others:
        _allow_writes(fleet, members[name])
    for guest in retired.guests:
        fleet.hosts[guest.host].storage.delete_volume(guest.marker)
    progress(retired.name, "back from retirement", 1.0)
    log.info("brought %s back from retirement (retired %s): %s led by %s", retired.name,
             time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(retired.retired_at)),
             ", ".join(f"{g.name} on {g.host}" for g in retired.guests), leader.name)
    return fleet.instance(retired.name)


def _wait_for_leader(fleet: Fleet, retired: RetiredInstance, answering: Mapping[str, Future[Guest]],
                     progress: Progress) -> Guest:
    """The member Patroni made leader, once it answers SQL. Patroni elects only after its members
    boot, so the wait is a boot's (the boot timeout) plus an election's (a leader key's TTL)."""
    assert fleet.patroni is not None
    timeout_s = fleet.boot_timeout_s + fleet.config.replication.patroni_ttl_s
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader = fleet.patroni.leader(retired.name, fresh=True)
        if leader is not None and leader in answering and answering[leader].done():
            return answering[leader].result()  # raises if it never answered
        failed = [name for name, future in answering.items() if future.done() and future.exception() is not None]
        if len(failed) == len(answering):
            answering[failed[0]].result()  # none of them came up: say why
        progress(retired.name, f"waiting for Patroni to elect a leader ({leader or 'none yet'})", 0.5)
        time.sleep(1.0)
    raise GuestNotReady(f"{retired.name}: no leader {timeout_s:.0f} s after its members started again "
                        f"({_why_no_leader(fleet)}); "
                        "its members' `journalctl -u pgcarve-patroni` says why")


def _why_no_leader(fleet: Fleet) -> str:
    error = fleet.patroni.error if fleet.patroni is not None else None
    return f"etcd cannot be read: {error}" if error else "no member holds its leader key"


def _allow_writes(fleet: Fleet, guest: Guest) -> None:
    with fleet.connect(guest) as conn:
        replication.allow_writes(conn)


def _follow_if_needed(fleet: Fleet, primary: Guest, standbys: Sequence[Guest]) -> None:
    """A standby whose primary came back at another address is pointed at the new one."""
    if primary.address is None:
        return
    with fleet.connect(primary) as conn:
        streaming = replication.streaming_standbys(conn)
    for standby in standbys:
        if application_name(standby.name) in streaming:
            continue
        with fleet.connect(standby) as conn:
            if replication.receiving(conn):
                continue
            replication.follow(conn, primary.address, standby.name, slot_name(standby.name),
                               fleet.instance_secrets(standby.info.metadata.cluster).replication_password)


# -- purge and crash clean-up -------------------------------------------------------------------

def purge(fleet: Fleet, name: str) -> RetiredInstance:
    """Delete a retired instance's disks, markers, records and passwords for good (asked for by
    name)."""
    index = index_of(fleet.config.fleet, name)
    running = fleet.instance_at(index, with_endpoints=False) if index is not None else None
    if running is not None:
        raise Conflict(f"{name} is not retired (it has guests: "
                       f"{', '.join(g.name for g in running.guests)}); scale down first, then purge it")
    retired = retired_instance(fleet, name)
    if retired is None:
        raise NotFound(f"no retired instance named {name!r}")
    with fleet.locks.exclusive(retired.index, "purging"):
        for guest in retired.guests:
            storage = fleet.hosts[guest.host].storage
            for volume in (disk_volume(guest.name), seed_volume(guest.name)):
                storage.delete_volume(volume)
            storage.delete_volume(guest.marker)
        fleet.sync_records.remove(name)
        forget_patroni_keys(fleet, name)
        fleet.secrets.remove(name)
    log.warning("purged retired instance %s: deleted %d MiB of disks (%s)", name, retired.disk_mib,
                ", ".join(f"{g.name} on {g.host}" for g in retired.guests))
    return retired


def finish_interrupted(fleet: Fleet) -> list[str]:
    """After a manager stopped mid-retirement or mid-revival: any guest that still exists while
    its retirement marker does is stopped and undefined again (disks kept). The instance is then
    retired as a whole; the next scale-up brings it back."""
    done = []
    for retired in retired_instances(fleet):
        left = _retire_again(fleet, retired)
        if left:
            done.append(f"{retired.name}: finished retiring {', '.join(left)} (disks kept)")
    return done
