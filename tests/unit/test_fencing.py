"""The fence in front of every change (virt/fencing.py, Fleet.check_fence): a manager that no
longer leads changes nothing on a host, while reads go on. libvirt's test driver stands in for a
host; the fence is a function that refuses, as Leadership.check does once the lease is lost."""

from __future__ import annotations

import pytest
from pgcarve.errors import NotLeader
from pgcarve.virt.host import LibvirtHost


def refuse(what: str) -> None:
    raise NotLeader(f"{what}: refused, it does not hold the fleet's leadership lease")


def test_a_fenced_host_changes_nothing_and_still_reads() -> None:
    host = LibvirtHost("h1", "test:///default")
    try:
        domain = host.conn.lookupByName("test")  # the test driver's running domain
        assert domain.isActive()
        host.fence = refuse
        with pytest.raises(NotLeader, match=r"stopping test on host h1: refused"):
            host.stop("test")
        with pytest.raises(NotLeader, match=r"removing test on host h1"):
            host.destroy("test")
        with pytest.raises(NotLeader, match=r"creating disk pgc-01-disk"):
            host.storage.create_overlay("pgc-01-disk", "base", 1)
        assert domain.isActive() and host.conn.lookupByName("test").isActive()
        assert host.versions()["libvirt"]  # reads are not fenced
        seen: list[str] = []
        host.fence = seen.append  # a leader: the check passes, and the step runs
        assert host.stop("test") is True and not domain.isActive()
        assert seen == ["stopping test on host h1"]
    finally:
        host.close()
