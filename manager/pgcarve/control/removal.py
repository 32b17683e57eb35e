"""Removing guests and instances, and cleaning up after a manager that stopped mid-operation."""

from __future__ import annotations

import contextlib
import logging

import psycopg

from pgcarve.control.fleet import Fleet, Instance
from pgcarve.control.retired import retired_instances
from pgcarve.errors import PgcarveError
from pgcarve.naming import application_name, disk_volume, instance_name, seed_volume, standby_name, volume_owner
from pgcarve.postgres import replication
from pgcarve.virt.domain_xml import mac_for
from pgcarve.virt.host import GuestInfo

log = logging.getLogger(__name__)


def remove_guest(fleet: Fleet, info: GuestInfo, keep_address: bool = False) -> None:
    """Power a guest off, forget it and delete its volumes (its data goes); `keep_address`: its
    fixed address stays reserved (it is built again under the same name)."""
    lv = fleet.hosts[info.host]
    fleet.planned_stops.will_stop(info.name)
    lv.destroy(info.name)
    for volume in (disk_volume(info.name), seed_volume(info.name)):
        lv.storage.delete_volume(volume)
    if not keep_address:
        release_address(fleet, info.host, info.name)
    fleet.forwards.remove(info.name)


def release_address(fleet: Fleet, host: str, name: str) -> None:
    """Drop guest `name`'s fixed address on `host`'s network, if it has one (virt/dhcp.py). A
    failure only leaves an address reserved for a name that may come back: logged, not raised."""
    try:
        fleet.hosts[host].release_address(fleet.config.host(host).network, mac_for(fleet.config.fleet, name))
    except PgcarveError as exc:
        log.warning("%s: its fixed address on %s stays reserved (%s)", name, host, exc)


def remove_instance(fleet: Fleet, instance: Instance) -> None:
    """Power off and delete a primary, its standbys and their disks (no data kept), then its
    synchronous-set record and its passwords: an instance made later under the same name gets
    new ones."""
    for guest in (*instance.standbys, *instance.stale, *((instance.primary,) if instance.primary else ())):
        remove_guest(fleet, guest.info)
    fleet.sync_records.remove(instance.name)
    forget_patroni_keys(fleet, instance.name)
    fleet.secrets.remove(instance.name)


def forget_patroni_keys(fleet: Fleet, instance: str) -> None:
    """An instance whose guests are gone leaves no keys in etcd (a later one of the same name
    bootstraps afresh). etcd not answering does not keep the guests: the next creation of that
    name removes what is left first (control/provisioning.py)."""
    if fleet.patroni is None:
        return
    try:
        fleet.patroni.forget(instance)
    except PgcarveError as exc:
        log.warning("%s: its Patroni keys stay in etcd for now (%s); they are removed before a new %s is made",
                    instance, exc, instance)


def instance_disk_mib(fleet: Fleet, instance: Instance) -> int:
    """The space an instance's guests' disks and seeds take on their hosts now (MiB)."""
    total = 0
    for guest in instance.guests:
        volumes = (disk_volume(guest.name), seed_volume(guest.name))
        total += sum(fleet.hosts[guest.info.host].storage.allocations_mib(volumes).values())
    return total


def discard_instance(fleet: Fleet, index: int) -> None:
    """Remove whatever exists of instance `index`, wherever it is: guests and their volumes."""
    fleet_name = fleet.config.fleet
    names = [instance_name(fleet_name, index)] + [standby_name(fleet_name, index, s)
                                                  for s in range(1, fleet.config.replication.standbys + 1)]
    for host in fleet.hosts.values():
        for name in names:
            fleet.planned_stops.will_stop(name)
            with contextlib.suppress(PgcarveError):
                host.destroy(name)
            for volume in (disk_volume(name), seed_volume(name)):
                with contextlib.suppress(PgcarveError):
                    host.storage.delete_volume(volume)
            release_address(fleet, host.name, name)
            fleet.forwards.remove(name)
    fleet.sync_records.remove(instance_name(fleet_name, index))
    forget_patroni_keys(fleet, instance_name(fleet_name, index))
    fleet.secrets.remove(instance_name(fleet_name, index))


def discard_half_made(fleet: Fleet) -> list[str]:
    """After a manager crash: remove what a killed operation left half-built (guests still
    marked "creating"), and volumes of this fleet that no guest uses.

    An instance whose guests are *all* marked was being created by a scale-up that never got
    past its primary's first answer (the primary's mark goes before any standby can clone
    from it: control/provisioning.py): it never acknowledged a commit, so it goes whole. Otherwise the
    instance may hold acknowledged commits and stays: only standbys still being built go (the
    HA loop builds them again), and a primary still marked is marked complete.

    Call before any operation runs (manager start, `pgcarve up`): it assumes nothing is being
    built right now."""
    removed = []
    guests = fleet.guests()
    marked = {g.metadata.index for g in guests if g.creating and g.metadata.created_by == "manager"}
    for index in sorted(marked):
        members = [g for g in guests if g.metadata.index == index]
        name = instance_name(fleet.config.fleet, index)
        if all(g.creating for g in members):
            discard_instance(fleet, index)
            removed.append(f"half-made instance {name} ({', '.join(sorted(g.name for g in members))})")
            continue
        for guest in members:
            if not guest.creating:
                continue
            if guest.metadata.role == "standby":
                remove_guest(fleet, guest)
                removed.append(f"half-built standby {guest.name} of {name} on {guest.host} "
                               "(the instance keeps its data; the standby is built again)")
            else:
                fleet.hosts[guest.host].mark_complete(guest.name)
    removed += _orphan_volumes(fleet)
    return removed


# A disk that never booted holds the overlay's header and little more; a booted guest's disk
# holds its logs, WAL and data, far beyond this.
NEVER_BOOTED_MIB = 16


def _orphan_volumes(fleet: Fleet) -> list[str]:
    """Delete volumes of this fleet that no guest uses and that hold no data: seeds, and disks
    that never booted (a manager killed between creating a disk and defining its guest).
    Retired disks (control/retired.py) stay, and so does any other disk that holds data:
    someone may have undefined its guest by hand; deleting it is for an operator to decide."""
    prefix = f"{fleet.config.fleet}-"
    retired = {(r.host, r.name) for inst in retired_instances(fleet) for r in inst.guests}
    removed = []
    for host_name, lv in fleet.hosts.items():
        orphans = [(v, owner) for v in sorted(lv.storage.volume_names()) if v.startswith(prefix)
                   for owner in (volume_owner(v),)
                   if owner is not None and (host_name, owner) not in retired and not lv.defined(owner)]
        sizes = lv.storage.allocations_mib([v for v, owner in orphans if v == disk_volume(owner)])
        holding = {owner for v, owner in orphans if sizes.get(v, 0) > NEVER_BOOTED_MIB}
        for owner in sorted(holding):
            log.warning("host %s: disk %s (%d MiB) belongs to no guest and holds data; kept with its seed "
                        "(delete them with virsh vol-delete if they are not needed)", host_name,
                        disk_volume(owner), sizes[disk_volume(owner)])
        for volume, owner in orphans:
            if owner in holding:
                continue
            lv.storage.delete_volume(volume)
            removed.append(f"volume {volume} on {host_name} (no guest uses it)")
    return removed


def leftovers(fleet: Fleet) -> list[str]:
    """Any pgcarve guest or volume of this fleet still on a host."""
    left = [f"guest {g.name} on {g.host}" for g in fleet.guests()]
    prefix = f"{fleet.config.fleet}-"
    for name, host in fleet.hosts.items():
        with contextlib.suppress(PgcarveError):
            left += [f"volume {v} on {name}" for v in sorted(host.storage.volume_names()) if v.startswith(prefix)]
    return left


def after_failed_create(fleet: Fleet, index: int, exc: BaseException, replaying: set[str]) -> None:
    """Remove a failed new instance, unless it could have acknowledged a commit: with
    synchronous replication, once a standby streamed from it (one that finished here, or one
    streaming now); without, from its first answer. Then the instance stays; only its standbys
    that never got going are removed (the HA loop builds them again). When its primary cannot
    be asked, assume it could have: keep the data."""
    name = instance_name(fleet.config.fleet, index)
    instance = fleet.instance_at(index)
    primary = instance.primary if instance else None
    if instance is None or primary is None or primary.info.creating:
        discard_instance(fleet, index)
        return
    config = fleet.config.replication
    try:
        with fleet.connect(primary, timeout_s=5) as conn:
            streaming = replication.streaming_standbys(conn)
        going = replaying | {g.name for g in instance.standbys if application_name(g.name) in streaming}
    except (psycopg.Error, PgcarveError):
        going = {g.name for g in instance.standbys}
    if not going and config.standbys and config.synchronous_commit not in ("off", "local"):
        discard_instance(fleet, index)
        return
    for guest in instance.standbys:
        if guest.name in going:
            fleet.hosts[guest.info.host].mark_complete(guest.name)
        else:
            remove_guest(fleet, guest.info)
    log.error("creating %s failed (%s), but it could already acknowledge commits: it is kept (primary %s); "
              "the HA loop builds its missing standbys", name, exc, primary.name)
