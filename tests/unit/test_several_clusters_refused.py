"""An instance whose guests run several PostgreSQL clusters (the benchmark's multi-instance
layout) is never failed over or switched over: the manager would move only the first cluster."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pgcarve.control.failover import Failover, refuse_several_clusters
from pgcarve.control.switchover import Switchover
from pgcarve.errors import Conflict


def fleet_with(clusters: int) -> Any:
    return SimpleNamespace(config=SimpleNamespace(instance=SimpleNamespace(clusters=clusters)))


def test_one_cluster_is_allowed() -> None:
    refuse_several_clusters(fleet_with(1), SimpleNamespace(name="pgc-01"), "fail over")  # type: ignore[arg-type]


@pytest.mark.parametrize("action", ["failover", "switchover"])
def test_several_clusters_are_refused_before_anything_is_touched(action: str) -> None:
    fleet = fleet_with(4)
    inst: Any = SimpleNamespace(name="pgcbm-01")  # any attribute read beyond its name would fail
    doer: Any = Failover.__new__(Failover) if action == "failover" else Switchover.__new__(Switchover)
    doer.fleet = fleet
    with pytest.raises(Conflict, match=r"pgcbm-01: will not (fail|switch) over: its guests run 4 PostgreSQL "
                                       r"clusters \(instance.clusters\)"):
        doer.run(inst)
