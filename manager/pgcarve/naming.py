"""How pgcarve names things: instances, their guests, and what PostgreSQL calls a standby."""

from __future__ import annotations


def instance_name(fleet: str, index: int) -> str:
    """Instance `index` of a fleet, which is also its first primary guest's name: pgc-01."""
    return f"{fleet}-{index:02d}"


def standby_name(fleet: str, index: int, standby: int) -> str:
    """Standby guest number `standby` of an instance: pgc-01-s1."""
    return f"{instance_name(fleet, index)}-s{standby}"


def standby_number(guest: str) -> int:
    """The standby number in a standby guest's name (pgc-01-s3: 3)."""
    _, _, number = guest.rpartition("-s")
    if not number.isdigit():
        raise ValueError(f"{guest!r} is not a standby guest's name")
    return int(number)


def guest_of(instance: str, guest: str) -> bool:
    """Whether a guest's name is one an instance's guests carry: the instance's own (its first
    primary) or <instance>-s<number> (a standby). A guest keeps its name through failovers, and
    Terraform's variables refuse any other, so looking an instance up by these names reads its
    guests only, where listing every guest's metadata would read the whole fleet."""
    if guest == instance:
        return True
    number = guest.removeprefix(f"{instance}-s")
    return number != guest and number.isdigit()


def index_of(fleet: str, instance: str) -> int | None:
    """The index of instance `instance` of `fleet` (None if the name is not one instance_name gives)."""
    digits = instance.removeprefix(f"{fleet}-")
    if digits == instance or not digits.isdigit():
        return None
    index = int(digits)
    return index if instance_name(fleet, index) == instance else None


def disk_volume(guest: str) -> str:
    """A guest's disk: a qcow2 overlay of the guest image in its host's storage pool."""
    return f"{guest}.qcow2"


def seed_volume(guest: str) -> str:
    """A guest's NoCloud seed (an ISO the guest reads at boot)."""
    return f"{guest}-seed.iso"


def volume_owner(volume: str) -> str | None:
    """The guest whose disk or seed this volume is (None for any other volume)."""
    for suffix in (".qcow2", "-seed.iso"):
        if volume.endswith(suffix):
            return volume.removesuffix(suffix)
    return None


def application_name(guest_name: str) -> str:
    """The name a standby reports to its primary (an identifier usable in synchronous_standby_names)."""
    return guest_name.replace("-", "_")


def slot_name(standby_guest: str) -> str:
    """The physical replication slot a standby streams through."""
    return "pgcarve_" + application_name(standby_guest)
