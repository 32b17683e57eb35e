"""Will a scale fit? CPUs and memory by the placement rule, disk by each host's storage pool.

Checked before an operation is accepted, so a request that can never succeed changes nothing.
"""

from __future__ import annotations

from pgcarve.control.fleet import Fleet
from pgcarve.errors import CapacityError


def check_capacity(fleet: Fleet, instances: int) -> None:
    """Refuse (CapacityError/ConfigError, naming the limit) a count the hosts cannot hold."""
    fleet.placement.check(instances)
    check_storage(fleet, instances)


def check_storage(fleet: Fleet, instances: int) -> None:
    """Refuse a scale-up whose new guests would not fit a host's storage pool (disk_reserve_mib each)."""
    reserve = fleet.config.instance.disk_reserve_mib
    present = {g.metadata.index for g in fleet.guests()}
    placement = fleet.placement
    new_guests: dict[str, int] = {}
    for index in range(1, instances + 1):
        if index in present:
            continue
        primary_host, standby_hosts = placement.hosts_for(index)
        for host in (primary_host, *standby_hosts):
            new_guests[host.name] = new_guests.get(host.name, 0) + 1
    for host_name, count in sorted(new_guests.items()):
        require_free_space(fleet, host_name, count * reserve, count)


def require_free_space(fleet: Fleet, host_name: str, needed_mib: int, guests: int = 1) -> None:
    """CapacityError, saying where and how much, unless the host's pool has `needed_mib` free."""
    if needed_mib <= 0:
        return
    storage = fleet.hosts[host_name].storage
    free = storage.pool_free_mib()
    if free < needed_mib:
        raise CapacityError(
            f"host {host_name}: storage pool {storage.pool_name} ({storage.pool_path}) has {free} MiB free; "
            f"{guests} new guest(s) need {needed_mib} MiB ({fleet.config.instance.disk_reserve_mib} MiB each, "
            "instance.disk_reserve_mib); free space there or lower the reserve"
        )
