"""The API's `patroni` field of an instance (control/patroni_roles.patroni_doc), from keys a real
Patroni wrote (tests/data/patroni): who leads, synchronous standbys, and the problem in words."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pgcarve.control.patroni_roles import patroni_doc
from pgcarve.patroni.view import ClusterView, cluster_views

from tests.unit.test_patroni_view import recorded


def view(release: str, case: str) -> ClusterView:
    found, revision = recorded(release, case)
    return cluster_views(found, revision)["pgc-01"]


@pytest.mark.parametrize("release", ["patroni-3.0.2", "patroni-4.0.7", "patroni-4.0.7-quorum"])
def test_steady_cluster_has_no_problem(release: str) -> None:
    steady = view(release, "steady")
    doc = patroni_doc(steady, None)
    assert doc["problem"] is None
    assert steady.leader and doc["leader"] == steady.leader.replace("_", "-")  # members are named pgc_01_s1
    assert doc["synchronous"] and doc["leader"] not in doc["synchronous"]  # type: ignore[operator]
    assert doc["synchronous_mode"] == ("quorum" if release.endswith("quorum") else "on")
    assert doc["leader"] in {m["name"] for m in doc["members"]}  # type: ignore[attr-defined]


def test_paused_lost_leader_and_no_sync_are_named() -> None:
    assert "paused" in str(patroni_doc(view("patroni-4.0.7", "paused"), None)["problem"])
    steady = view("patroni-4.0.7", "steady")
    assert str(patroni_doc(replace(steady, leader=None), None)["problem"]).startswith("no leader")
    assert str(patroni_doc(replace(steady, sync=None), None)["problem"]).startswith("no synchronous standby")


def test_unreadable_etcd_says_so() -> None:
    doc = patroni_doc(None, "no etcd endpoint answered")
    assert doc["leader"] is None and doc["problem"] == "etcd cannot be read: no etcd endpoint answered"
    assert patroni_doc(None, None)["problem"] == "no Patroni keys in etcd for this instance yet"
