"""The synchronous set the manager keeps (control/sync.py): it names exactly k standbys, records
before it changes, switches when a chosen one stops streaming, shrinks only once confirmed."""

from __future__ import annotations

from pathlib import Path

import pytest
from pgcarve.config import Replication
from pgcarve.control.sync import ReplicaState, initial_record, names_for, plan_sync
from pgcarve.control.sync_record import SyncRecord

STANDBYS = ["pgc-01-s1", "pgc-01-s2"]


def rec(members: tuple[str, ...], synchronous: tuple[str, ...], pending: int | None = None) -> SyncRecord:
    return SyncRecord(instance="pgc-01", primary="pgc-01", primary_host="h0", members=members,
                      synchronous=synchronous, count=1, mode="FIRST", pending_lsn=pending)


def up(lsn: int, sync_state: str = "async") -> ReplicaState:
    return ReplicaState(streaming=True, sync_state=sync_state, write_lsn=lsn)


def test_a_new_instance_names_its_first_k_standbys() -> None:
    first = initial_record("pgc-01", "pgc-01", "h0", STANDBYS, Replication())
    assert first is not None and first.synchronous == ("pgc-01-s1",) and first.members == ("pgc-01-s1",)
    assert names_for(first) == "FIRST 1 (pgc_01_s1)"
    anyk = initial_record("pgc-01", "pgc-01", "h0", STANDBYS,
                          Replication(sync_mode="ANY", sync_count=1))
    assert anyk is not None and names_for(anyk) == "ANY 1 (pgc_01_s1, pgc_01_s2)"
    assert initial_record("pgc-01", "pgc-01", "h0", [], Replication()) is None


def test_nothing_changes_while_the_chosen_standby_streams() -> None:
    r = rec(("pgc-01-s1",), ("pgc-01-s1",))
    assert plan_sync(r, STANDBYS, {"pgc-01-s1": up(100, "sync"), "pgc-01-s2": up(90)}, 100, {}, 5.0) is None


def test_a_brief_gap_does_not_switch_but_a_lasting_one_does_recording_first() -> None:
    r = rec(("pgc-01-s1",), ("pgc-01-s1",))
    replicas = {"pgc-01-s2": up(90)}
    assert plan_sync(r, STANDBYS, replicas, 100, {"pgc-01-s1": 2.0}, 5.0) is None
    change = plan_sync(r, STANDBYS, replicas, 100, {"pgc-01-s1": 6.0}, 5.0)
    assert change is not None
    # The record grows to hold both before the names move to s2.
    assert change.record.members == ("pgc-01-s1", "pgc-01-s2")
    assert change.record.synchronous == ("pgc-01-s2",) and change.record.pending_lsn == 100
    assert change.names == "FIRST 1 (pgc_01_s2)" and "not streaming" in change.reason


def test_no_spare_means_keep_waiting_on_the_chosen_one() -> None:
    r = rec(("pgc-01-s1",), ("pgc-01-s1",))
    assert plan_sync(r, STANDBYS, {}, 100, {"pgc-01-s1": 60.0, "pgc-01-s2": 60.0}, 5.0) is None


def test_the_record_shrinks_only_once_the_new_standby_confirmed_everything_before_the_change() -> None:
    r = rec(("pgc-01-s1", "pgc-01-s2"), ("pgc-01-s2",), pending=100)
    assert plan_sync(r, STANDBYS, {"pgc-01-s2": up(99, "sync")}, 120, {}, 5.0) is None  # not yet
    assert plan_sync(r, STANDBYS, {"pgc-01-s2": up(100, "async")}, 120, {}, 5.0) is None  # not sync yet
    change = plan_sync(r, STANDBYS, {"pgc-01-s2": up(100, "sync")}, 120, {}, 5.0)
    assert change is not None and change.record.members == ("pgc-01-s2",) and change.names is None


def test_the_most_advanced_spare_is_chosen() -> None:
    standbys = ["pgc-01-s1", "pgc-01-s2", "pgc-01-s3"]
    r = rec(("pgc-01-s1",), ("pgc-01-s1",))
    change = plan_sync(r, standbys, {"pgc-01-s2": up(80), "pgc-01-s3": up(95)}, 100, {"pgc-01-s1": 9.0}, 5.0)
    assert change is not None and change.record.synchronous == ("pgc-01-s3",)


def test_a_terraform_primary_whose_standbys_are_not_there_yet_is_recorded_with_the_planned_ones(
        tmp_path: Path) -> None:
    """Terraform applied the primary host first: its seed names pgc_01_s1, which has no guest
    yet. The record the keeper adopts holds the planned standby, not nobody, so the keeper never
    clears the names its commits wait on."""
    from types import SimpleNamespace

    from pgcarve.control.sync import SyncKeeper
    from pgcarve.control.sync_record import SyncRecords

    config = SimpleNamespace(fleet="pgc", replication=Replication())
    records = SyncRecords(tmp_path)
    keeper = SyncKeeper(SimpleNamespace(config=config), records)  # type: ignore[arg-type]
    primary = SimpleNamespace(name="pgc-01", info=SimpleNamespace(host="h0"))
    inst = SimpleNamespace(name="pgc-01", index=1, primary=primary, standbys=[])
    record = keeper._adopt(inst, "FIRST 1 (pgc_01_s1)", 4096)  # type: ignore[arg-type]
    assert record.synchronous == ("pgc-01-s1",) and record.members == ("pgc-01-s1",)
    assert names_for(record) == "FIRST 1 (pgc_01_s1)"
    assert records.get("pgc-01") == record
    # Nobody streams yet: the keeper keeps waiting on the chosen one rather than switching.
    assert plan_sync(record, [], {}, 4096, {}, 5.0) is None


def test_a_recorded_primary_that_streams_from_another_server_is_never_promoted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record names pgc-01-s1 (a failover long ago), but the instance's guests were all made
    again: pgc-01-s1 is now a standby streaming from the new pgc-01. Promoting it would make a
    second primary; the keeper leaves it be and says why."""
    from types import SimpleNamespace

    from pgcarve.control import sync
    from pgcarve.control.sync_record import SyncRecords

    records = SyncRecords(tmp_path)
    records.put(SyncRecord(instance="pgc-01", primary="pgc-01-s1", primary_host="h1", members=("pgc-01-s2",),
                           synchronous=("pgc-01-s2",)))
    keeper = sync.SyncKeeper(SimpleNamespace(config=None), records)  # type: ignore[arg-type]
    promoted: list[object] = []
    def promote(conn: object, timeout: float) -> bool:
        promoted.append(conn)
        return True

    monkeypatch.setattr(sync.replication, "promote", promote)
    monkeypatch.setattr(sync.replication, "set_synchronous_standby_names", lambda conn, names: None)
    monkeypatch.setattr(sync.replication, "settle_new_primary", lambda conn: None)
    inst = SimpleNamespace(name="pgc-01", primary=SimpleNamespace(name="pgc-01-s1"))
    for streams, expected in ((True, []), (False, ["conn"])):
        monkeypatch.setattr(sync.replication, "receiving", lambda conn, s=streams: s)
        keeper._unfence(inst, "conn")  # type: ignore[arg-type]
        assert promoted == expected
