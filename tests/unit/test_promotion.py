"""The promotion rule: a standby is promoted automatically only if it provably holds every
acknowledged commit; checked against a model of commits acknowledged by k members of R."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pgcarve.control.promotion import StandbyAnswer, decide, force
from pgcarve.control.sync_record import SyncRecord, SyncRecords
from pgcarve.errors import ConfigError

STANDBYS = ("s1", "s2", "s3")


def record(members: tuple[str, ...], count: int = 1) -> SyncRecord:
    return SyncRecord(instance="pgc-01", primary="p", primary_host="h0", members=members, count=count,
                      mode="FIRST" if count == 1 else "ANY")


def answer(name: str, lsn: int, answered: bool = True, in_recovery: bool = True) -> StandbyAnswer:
    return StandbyAnswer(name=name, host=f"host-{name}", answered=answered, in_recovery=in_recovery,
                         received_lsn=lsn)


def test_first_1_with_one_recorded_standby_needs_that_standby() -> None:
    r = record(("s1",))
    ok = decide(r, [answer("s1", 100), answer("s2", 90)])
    assert ok.candidate == "s1" and ok.proven
    lost = decide(r, [answer("s1", 0, answered=False), answer("s2", 90)])
    assert lost.candidate is None and not lost.proven
    assert "1 must answer" in lost.reason and "s1" in lost.reason and "force" in lost.reason


def test_the_answering_standby_with_most_wal_is_chosen_even_outside_the_set() -> None:
    # s2 received more than s1 (the only synchronous one): s2 has everything s1 has.
    r = record(("s1",))
    assert decide(r, [answer("s1", 100), answer("s2", 120)]).candidate == "s2"


def test_two_recorded_standbys_with_k_1_need_both() -> None:
    r = record(("s1", "s2"))
    assert r.quorum == 2
    assert decide(r, [answer("s1", 100), answer("s2", 0, answered=False)]).candidate is None
    assert decide(r, [answer("s1", 100), answer("s2", 110)]).candidate == "s2"


def test_an_already_promoted_standby_is_never_joined_by_a_second() -> None:
    r = record(("s1",))
    d = decide(r, [answer("s1", 100), answer("s2", 200, in_recovery=False)])
    assert d.candidate == "s2" and "already promoted" in d.reason


def test_empty_set_promotes_nothing() -> None:
    assert decide(record(()), [answer("s1", 100)]).candidate is None


def test_forced_promotion_says_what_may_be_missing() -> None:
    r = record(("s1",))
    forced = force(r, [answer("s1", 0, answered=False), answer("s2", 90)], "s2")
    assert forced.candidate == "s2" and not forced.proven
    assert "s1" in forced.may_be_missing
    assert force(r, [answer("s2", 0, answered=False)], "s2").candidate is None
    proven = force(r, [answer("s1", 100), answer("s2", 90)], "s1")
    assert proven.proven and proven.may_be_missing == ""


def test_record_refuses_nonsense_and_round_trips_durably(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        SyncRecord(instance="pgc-01", primary="s1", primary_host="h0", members=("s1",))
    with pytest.raises(ConfigError):
        record(("s1",), count=0)
    store = SyncRecords(tmp_path / "sync")
    assert store.get("pgc-01") is None
    first = store.put(record(("s1", "s2")))
    second = store.put(first.next(members=("s2",), failover_to="s2"))
    assert store.get("pgc-01") == second and second.generation == 2
    assert [r.instance for r in store.all()] == ["pgc-01"]
    (tmp_path / "sync" / "pgc-01.json").write_text("{broken")
    with pytest.raises(ConfigError, match="not valid JSON"):
        store.get("pgc-01")


@settings(max_examples=400, deadline=None)
@given(
    members=st.lists(st.sampled_from(STANDBYS), min_size=1, max_size=3, unique=True),
    count=st.integers(min_value=1, max_value=3),
    commits=st.lists(st.tuples(st.integers(min_value=0, max_value=7), st.randoms(use_true_random=False)),
                     max_size=12),
    extra=st.dictionaries(st.sampled_from(STANDBYS), st.integers(min_value=0, max_value=5)),
    answering=st.sets(st.sampled_from(STANDBYS)),
)
def test_a_promoted_standby_holds_every_acknowledged_commit(
    members: list[str], count: int, commits: list[tuple[int, object]], extra: dict[str, int], answering: set[str],
) -> None:
    """Model: WAL grows by commits; each commit is acknowledged once `count` members of R received
    it (the others may lag); standbys outside R may receive any prefix. Whatever answers, a
    standby the rule promotes has received every acknowledged commit."""
    count = min(count, len(members))
    r = record(tuple(members), count)
    received = dict.fromkeys(STANDBYS, 0)
    lsn = 0
    last_acked = 0
    for step, rnd in commits:
        lsn += 1 + step
        confirming = rnd.sample(members, count)  # type: ignore[attr-defined]
        for name in confirming:
            received[name] = lsn
        last_acked = lsn
        for name in STANDBYS:  # others stream too, but may be anywhere behind
            if name not in confirming:
                received[name] = max(received[name], rnd.randint(received[name], lsn))  # type: ignore[attr-defined]
    for name, more in extra.items():  # unacknowledged WAL some standbys already have
        received[name] += more
    answers = [answer(n, received[n], answered=n in answering) for n in STANDBYS]
    decision = decide(r, answers)
    if decision.candidate is not None:
        assert received[decision.candidate] >= last_acked
        assert decision.proven
    elif len([m for m in members if m in answering]) >= r.quorum:
        raise AssertionError(f"a quorum answered but nothing was promoted: {decision.reason}")
