"""Will a scale fit? CPUs and memory by the placement rule, disk by each host's storage pool.

Checked before an operation is accepted, so a request that can never succeed changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pgcarve.control.fleet import Fleet
from pgcarve.control.retired import RetiredInstance, in_the_way, retired_instances
from pgcarve.errors import CapacityError
from pgcarve.virt.host import GuestInfo


def check_capacity(fleet: Fleet, instances: int, guests: Sequence[GuestInfo] | None = None,
                   retired: Sequence[RetiredInstance] | None = None) -> None:
    """Refuse (CapacityError/ConfigError, naming the limit) a count the hosts cannot hold.
    `guests` and `retired`: a listing the caller just made (fleet.guests(), retired_instances()),
    else they are listed here."""
    fleet.placement.check(instances)
    check_storage(fleet, instances, guests, retired)


def check_storage(fleet: Fleet, instances: int, guests: Sequence[GuestInfo] | None = None,
                  retired_list: Sequence[RetiredInstance] | None = None) -> None:
    """Refuse a scale-up whose guests to start would not fit a host's storage pool
    (disk_reserve_mib each): new instances' guests where the placement puts them, retired
    instances' guests where their kept disks are. Kept disks of instances that stay retired are
    named when they are what is in the way."""
    reserve = fleet.config.instance.disk_reserve_mib
    present = {g.metadata.index for g in (fleet.guests() if guests is None else guests)}
    retired = {r.index: r for r in (retired_instances(fleet) if retired_list is None else retired_list)}
    placement = fleet.placement
    starting: dict[str, int] = {}
    for index in range(1, instances + 1):
        if index in present:
            continue
        if index in retired:
            hosts = [g.host for g in retired[index].guests]
        else:
            primary_host, standby_hosts = placement.hosts_for(index)
            hosts = [h.name for h in (primary_host, *standby_hosts)]
        for host in hosts:
            starting[host] = starting.get(host, 0) + 1
    for host_name, count in sorted(starting.items()):
        require_free_space(fleet, host_name, count * reserve, count,
                           in_the_way(retired.values(), host_name, reviving=range(1, instances + 1)))


def require_free_space(fleet: Fleet, host_name: str, needed_mib: int, guests: int = 1, why: str = "") -> None:
    """CapacityError, saying where and how much, unless the host's pool has `needed_mib` free."""
    if needed_mib <= 0:
        return
    storage = fleet.hosts[host_name].storage
    free = storage.pool_free_mib()
    if free < needed_mib:
        raise CapacityError(
            f"host {host_name}: storage pool {storage.pool_name} ({storage.pool_path}) has {free} MiB free; "
            f"{guests} guest(s) to start need {needed_mib} MiB ({fleet.config.instance.disk_reserve_mib} MiB each, "
            f"instance.disk_reserve_mib); free space there or lower the reserve{why}"
        )
