"""Removing guests and instances, and cleaning up after a manager that stopped mid-operation."""

from __future__ import annotations

import contextlib

from pgcarve.control.fleet import Fleet, Instance
from pgcarve.errors import PgcarveError
from pgcarve.naming import instance_name, standby_name
from pgcarve.virt.host import GuestInfo


def volumes_of(guest: str) -> tuple[str, str]:
    """A guest's disk and seed volumes."""
    return f"{guest}.qcow2", f"{guest}-seed.iso"


def remove_guest(fleet: Fleet, info: GuestInfo) -> None:
    """Power a guest off, forget it and delete its volumes (its data goes)."""
    lv = fleet.hosts[info.host]
    fleet.planned_stops.will_stop(info.name)
    lv.destroy(info.name)
    for volume in volumes_of(info.name):
        lv.storage.delete_volume(volume)
    fleet.forwards.remove(info.name)


def remove_instance(fleet: Fleet, instance: Instance) -> None:
    """Power off and delete a primary, its standbys and their disks (no data kept), then its
    passwords: an instance made later under the same name gets new ones."""
    for guest in (*instance.standbys, *((instance.primary,) if instance.primary else ())):
        remove_guest(fleet, guest.info)
    fleet.secrets.remove(instance.name)


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
            for volume in volumes_of(name):
                with contextlib.suppress(PgcarveError):
                    host.storage.delete_volume(volume)
            fleet.forwards.remove(name)
    fleet.secrets.remove(names[0])


def discard_half_made(fleet: Fleet) -> list[str]:
    """After a manager crash: remove what a killed operation left half-built (guests still
    marked "creating"), and volumes of this fleet that no guest uses.

    An instance whose guests are *all* marked was being created by a scale-up and never
    finished: it never held an acknowledged commit, so it goes whole. Otherwise the instance
    holds data: only a standby that was being rebuilt goes (the HA loop builds it again),
    and a primary still marked is one whose marking was cut short, so it is marked complete.

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
    prefix = f"{fleet.config.fleet}-"
    for host_name, lv in fleet.hosts.items():
        for volume in sorted(lv.storage.volume_names()):
            owner = volume.removesuffix(".qcow2").removesuffix("-seed.iso")
            if volume.startswith(prefix) and owner != volume and not lv.defined(owner):
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
