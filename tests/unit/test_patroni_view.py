"""Patroni's keys and REST answers, as real Patroni clusters wrote them (tests/data/patroni/: two
and three members on loopback, Patroni 3.0.2 from Debian 12 and 4.0.7 as Debian 13 ships it,
recorded by the harness of tests/integration/test_patroni_local.py), read into pgcarve's views."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pgcarve.dcs.etcd import EtcdClient, KeyValue, prefix_range_end
from pgcarve.patroni.rest import cluster_status, member_status
from pgcarve.patroni.view import ClusterView, cluster_views, scope_prefix

from tests.support.etcd import CONFIG

DATA = Path(__file__).resolve().parents[1] / "data" / "patroni"
V3, V4, QUORUM = "patroni-3.0.2", "patroni-4.0.7", "patroni-4.0.7-quorum"


def recorded(release: str, stage: str, scope: str = "pgc-01") -> tuple[list[KeyValue], int]:
    """A recorded range answer; its keys moved to `scope` (every recording is of scope pgc-01)."""
    doc = json.loads((DATA / release / f"{stage}.json").read_text())
    kvs = [KeyValue(**{**kv, "key": kv["key"].replace("/service/pgc-01/", f"/service/{scope}/")})
           for kv in doc["kvs"]]
    return kvs, int(doc["revision"])


def view(release: str, stage: str) -> ClusterView:
    kvs, revision = recorded(release, stage)
    return cluster_views(kvs, revision)["pgc-01"]


def rest(release: str, name: str) -> dict[str, object]:
    return dict(json.loads((DATA / release / f"{name}.json").read_text()))


def leader_key(release: str, stage: str) -> str:
    """The leader key's value as recorded (the raw text, not through the view)."""
    kvs, _ = recorded(release, stage)
    return next(kv.value for kv in kvs if kv.key.endswith("/leader"))


@pytest.mark.parametrize("release", [V3, V4])
def test_a_steady_cluster_shows_its_leader_and_its_synchronous_standby(release: str) -> None:
    cluster = view(release, "steady")
    leader = leader_key(release, "steady")
    (standby,) = {"pgc-01", "pgc-01-s1"} - {leader}
    assert cluster.leader == leader and cluster.synchronous_standbys == (standby,)
    assert [m.name for m in cluster.members] == ["pgc-01", "pgc-01-s1"]
    lead, other = cluster.member(leader), cluster.member(standby)
    assert lead is not None and other is not None
    assert lead.role == "primary" and other.role == "replica"  # 3.0's "master" is read as "primary"
    assert lead.running and other.running and lead.lag_bytes is None
    assert other.lag_bytes == 0  # it had received up to (or past) the leader's last recorded LSN
    assert cluster.timeline == 1 and cluster.history == ()
    assert cluster.settings is not None and cluster.settings.synchronous_mode == "on"
    assert cluster.settings.ttl == 20 and cluster.settings.loop_wait == 1 and not cluster.paused
    # failsafe_mode is on, and the leader wrote the members it must reach to keep its role without etcd.
    assert cluster.failsafe_mode and set(cluster.failsafe_members or {}) == {"pgc-01", "pgc-01-s1"}
    assert cluster.system_identifier is not None and cluster.system_identifier.isdigit()
    assert lead.api_url is not None and lead.api_url.startswith("https://127.0.0.1:")
    assert cluster.pending is None and cluster.sync is not None and cluster.sync.quorum == 0
    # Member keys live under their own Patroni's lease; the leader key under the leader's.
    kvs, _ = recorded(release, "steady")
    (lock,) = [kv for kv in kvs if kv.key.endswith("/leader")]
    assert lead.lease == lock.lease != other.lease and "0" not in (lead.lease, other.lease)


def test_patroni_4_writes_replication_state_and_slots_that_3_does_not() -> None:
    v3, v4 = view(V3, "steady"), view(V4, "steady")
    assert [m.replication_state for m in v4.members if m.name != v4.leader] == ["streaming"]
    assert [m.replication_state for m in v3.members] == [None, None]
    assert set(v4.slots) == {"pgc_01", "pgc_01_s1"} and dict(v3.slots) == {}
    assert v4.member("pgc-01").patroni_version == "4.0.7"  # type: ignore[union-attr]
    assert v3.member("pgc-01").patroni_version == "3.0.2"  # type: ignore[union-attr]


@pytest.mark.parametrize("release", [V3, V4, QUORUM])
def test_after_a_switchover_the_view_follows_the_new_leader_and_timeline(release: str) -> None:
    before, after = view(release, "steady"), view(release, "after_switchover")
    new_leader = leader_key(release, "after_switchover")
    assert after.leader == new_leader != before.leader and new_leader in before.synchronous_standbys
    assert before.leader in after.synchronous_standbys
    assert set(after.synchronous_standbys) == {m.name for m in after.members} - {new_leader}
    assert after.timeline == 2 and after.member(new_leader).role == "primary"  # type: ignore[union-attr]
    (switch,) = after.history
    assert switch.timeline == 1 and switch.new_leader == new_leader and switch.lsn > 0
    assert after.pending is None  # the `failover` key is "{}" once done
    assert after.revision > before.revision
    answered = cluster_status(rest(release, "rest_cluster_after_switchover"))
    assert answered.leader == new_leader and all(m.timeline == 2 for m in answered.members)


@pytest.mark.parametrize("release", [V3, V4, QUORUM])
def test_a_paused_cluster_says_so_in_its_settings_and_every_member(release: str) -> None:
    cluster = view(release, "paused")
    assert cluster.paused and all(m.paused for m in cluster.members)
    assert not view(release, "after_switchover").paused


def test_quorum_mode_names_every_quorum_standby_and_the_quorum() -> None:
    for stage in ("steady", "after_switchover"):
        cluster = view(QUORUM, stage)
        assert cluster.settings is not None and cluster.settings.synchronous_mode == "quorum"
        assert cluster.leader == leader_key(QUORUM, stage)
        assert set(cluster.synchronous_standbys) == {"pgc-01", "pgc-01-s1", "pgc-01-s2"} - {cluster.leader}
        assert cluster.sync is not None and cluster.sync.quorum == 1
        assert sorted(m.lag_bytes is None for m in cluster.members) == [False, False, True]
    answered = cluster_status(rest(QUORUM, "rest_cluster_after_switchover"))
    assert sorted(m.role for m in answered.members) == ["leader", "quorum_standby", "quorum_standby"]


def test_a_leader_without_etcd_says_it_keeps_its_role_in_failsafe_mode() -> None:
    """Recorded with etcd stopped under a Patroni 4.0.7 leader that reached its standbys. (Patroni
    3.0.2 demoted itself instead: "failed to update leader lock", the bug fixed in 4.0.7 by
    patroni/patroni#3404, so Debian 12's Patroni has no such recording.)"""
    for release, standbys in ((V4, 1), (QUORUM, 2)):
        status = member_status(rest(release, "rest_patroni_failsafe_leader"))
        assert status.failsafe_active and status.role == "primary"
        assert status.state == "running" and len(status.replication) == standbys
        assert not member_status(rest(release, "rest_patroni_leader")).failsafe_active


def test_every_scope_is_read_from_one_range_answer() -> None:
    kvs: list[KeyValue] = []
    for index, (release, stage) in enumerate([(V3, "steady"), (V4, "after_switchover"), (QUORUM, "steady")]):
        kvs += recorded(release, stage, f"pgc-{index:02d}")[0]
    kvs.append(KeyValue("/service/pgc-00/0/leader", "x", 1, 1, 1, "0"))  # another layout (Citus groups)
    kvs.append(KeyValue("/elsewhere/pgc-09/leader", "x", 1, 1, 1, "0"))
    views = cluster_views(sorted(kvs, key=lambda kv: kv.key), 99)
    assert list(views) == ["pgc-00", "pgc-01", "pgc-02"]
    assert [v.leader for v in views.values()] == [leader_key(V3, "steady"), leader_key(V4, "after_switchover"),
                                                  leader_key(QUORUM, "steady")]
    assert all(v.revision == 99 for v in views.values())
    assert views["pgc-02"] == view(QUORUM, "steady").__class__(**{**view(QUORUM, "steady").__dict__,
                                                                  "scope": "pgc-02", "revision": 99})


def test_a_sync_key_of_a_former_leader_names_no_synchronous_standby() -> None:
    kvs, revision = recorded(V4, "after_switchover")
    leader = leader_key(V4, "after_switchover")
    (former,) = {"pgc-01", "pgc-01-s1"} - {leader}
    stale = [kv if not kv.key.endswith("/sync") else KeyValue(kv.key, json.dumps(
        {"leader": former, "quorum": 0, "sync_standby": leader}), 1, 1, 1, "0") for kv in kvs]
    assert cluster_views(stale, revision)["pgc-01"].synchronous_standbys == ()
    assert cluster_views(kvs, revision)["pgc-01"].synchronous_standbys == (former,)


def test_keys_patroni_would_not_parse_are_read_as_absent_not_as_a_failure() -> None:
    kvs = [KeyValue(f"/service/pgc-01/{key}", value, 1, 1, 1, "0") for key, value in [
        ("leader", "pgc-01"), ("members/pgc-01", "{"), ("sync", "[]"), ("config", "not json"), ("status", "12"),
        ("history", '[["x"], [3, 100, "r"]]'), ("failsafe", "null"), ("failover", "{}")]]
    cluster = cluster_views(kvs, 5)["pgc-01"]
    (member,) = cluster.members
    assert member.role == "unknown" and member.state == "unknown" and not member.running
    assert cluster.sync is None and cluster.settings is None and cluster.synchronous_standbys == ()
    assert cluster.leader_lsn == 12 and cluster.failsafe_members is None and cluster.pending is None
    assert cluster.history[0].timeline == 3 and cluster.timeline == 4  # the leader's own key had none


def test_patroni_3_and_4_rest_answers_are_read_alike() -> None:
    for release in (V3, V4):
        leader, replica = member_status(rest(release, "rest_patroni_leader")), \
            member_status(rest(release, "rest_patroni_replica"))
        assert leader.role == "primary" and replica.role == "replica" and leader.state == "running"
        assert leader.wal_position is not None and replica.replayed_position is not None
        assert [(r.state, r.sync_state) for r in leader.replication] == [("streaming", "sync")]
        assert leader.timeline == 1 and leader.system_identifier == replica.system_identifier
        assert not leader.failsafe_active and not leader.paused
        cluster = cluster_status(rest(release, "rest_cluster"))
        assert cluster.leader == view(release, "steady").leader
        assert sorted(m.role for m in cluster.members) == ["leader", "sync_standby"]
    assert member_status(rest(V4, "rest_patroni_leader")).name == leader_key(V4, "steady")  # 4.0 names itself
    assert member_status(rest(V3, "rest_patroni_leader")).name is None  # 3.0 does not
    quorum = cluster_status(rest(QUORUM, "rest_cluster"))
    assert sorted(m.role for m in quorum.members) == ["leader", "quorum_standby", "quorum_standby"]
    assert {r.sync_state for r in member_status(rest(QUORUM, "rest_patroni_leader")).replication} == {"quorum"}


@pytest.mark.parametrize(("prefix", "end"), [(b"/service/", b"/service0"), (b"a\xff", b"b"), (b"\xff\xff", b"\0")])
def test_a_prefix_range_ends_after_every_key_under_it(prefix: bytes, end: bytes) -> None:
    assert prefix_range_end(prefix) == end


@pytest.mark.parametrize("scope", ["", "a/b", "../x", "-x", "pgc 01", "x" * 64])
def test_a_scope_that_is_not_one_name_is_refused(scope: str) -> None:
    with pytest.raises(ValueError, match="is not a Patroni scope"):
        scope_prefix(scope)


@pytest.mark.parametrize("prefix", ["/service/", "/", "service/pgc-01/", "/service/pgc-01"])
def test_a_delete_under_a_shallow_or_open_prefix_is_refused_before_any_request(prefix: str) -> None:
    client = EtcdClient.__new__(EtcdClient)  # no TLS files needed: it must refuse before any request
    client.config = CONFIG
    with pytest.raises(ValueError, match="refusing to delete"):
        client.delete_prefix(prefix)


@pytest.mark.parametrize("namespace", ["", "/", "service/", "/service", "//"])
def test_a_namespace_that_is_not_a_directory_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="must be a directory"):
        scope_prefix("pgc-01", namespace)
