"""RateTracker arithmetic: joins, leaves, resets, gaps, bad clocks, missing pg_stat_statements."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pgcarve.control.rates import InstanceRate, RateTracker, Sample, Snapshot


class FakeWall:
    """Wall clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def s(
    instance: str,
    t: float,
    xacts: int,
    calls: int | None = 0,
    lag: int | None = None,
    epoch: str = "e1",
    wall: float | None = None,
) -> Sample:
    """Sample at monotonic t; wall = 1e6 + t unless given."""
    return Sample(
        instance=instance,
        monotonic=t,
        wall=1_000_000.0 + t if wall is None else wall,
        xacts=xacts,
        calls=calls,
        replay_lag_bytes=lag,
        epoch=epoch,
    )


def snap_at(tr: RateTracker, t: float) -> Snapshot:
    return tr.snapshot(now_wall=1_000_000.0 + t)


def test_rate_is_delta_over_monotonic_delta() -> None:
    tr = RateTracker()
    tr.observe(s("a", 10.0, 1000, 5000))
    tr.observe(s("a", 12.0, 1300, 5900))
    r = snap_at(tr, 12.0).instances["a"]
    assert r.tps == pytest.approx(150.0)
    assert r.qps == pytest.approx(450.0)
    assert r.interval_s == pytest.approx(2.0)
    assert r.has_rate


def test_first_sample_is_listed_with_zero_rate_until_second() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 10**9, 10**9, lag=42))
    snap = snap_at(tr, 0.0)
    assert snap.instances["a"] == InstanceRate(tps=0.0, qps=0.0, replay_lag_bytes=42, interval_s=0.0,
                                               sampled_at=1_000_000.0)
    assert not snap.instances["a"].has_rate
    assert snap.aggregate_tps == 0.0
    assert snap.window_s == 0.0


def test_join_mid_window_does_not_spike_aggregate() -> None:
    tr = RateTracker()
    for i in range(4):
        tr.observe(s("a", float(i), 100 * i, 200 * i))
    before = snap_at(tr, 3.0)
    assert before.aggregate_tps == pytest.approx(100.0)
    # A busy instance joins with a huge counter: its counter is a baseline, not a delta from 0.
    tr.observe(s("b", 3.4, 50_000_000, 80_000_000))
    joined = snap_at(tr, 3.4)
    assert joined.aggregate_tps == pytest.approx(before.aggregate_tps)
    assert joined.aggregate_qps == pytest.approx(before.aggregate_qps)
    assert set(joined.instances) == {"a", "b"}
    tr.observe(s("a", 4.0, 400, 800))
    tr.observe(s("b", 4.4, 50_000_050, 80_000_100))
    after = snap_at(tr, 4.4)
    assert after.aggregate_tps == pytest.approx(150.0)
    assert after.aggregate_qps == pytest.approx(300.0)


def test_forget_removes_instance_from_aggregate_at_once() -> None:
    tr = RateTracker()
    for name in ("a", "b"):
        tr.observe(s(name, 0.0, 0, 0))
        tr.observe(s(name, 1.0, 100, 100))
    assert snap_at(tr, 1.0).aggregate_tps == pytest.approx(200.0)
    tr.forget("b")
    snap = snap_at(tr, 1.0)
    assert snap.aggregate_tps == pytest.approx(100.0)
    assert set(snap.instances) == {"a"}
    assert tr.instances() == ["a"]
    tr.forget("never-seen")  # harmless
    # Coming back is a fresh join, not a delta against the counters from before it left.
    tr.observe(s("b", 5.0, 10_000, 10_000))
    assert snap_at(tr, 5.0).instances["b"].tps == 0.0


@pytest.mark.parametrize("field", ["xacts", "both"])
def test_counter_going_down_is_a_reset_not_a_negative_rate(field: str) -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 5000, 9000))
    tr.observe(s("a", 1.0, 5100, 9200))
    # Stats reset / restart / failover: counters start again near zero.
    tr.observe(s("a", 2.0, 30, 9300 if field == "xacts" else 40))
    r = snap_at(tr, 2.0).instances["a"]
    assert r.tps == 0.0 and r.qps == 0.0 and not r.has_rate
    assert snap_at(tr, 2.0).aggregate_tps == 0.0
    # Re-baselined on the low value: the next interval is a normal rate, not a spike.
    tr.observe(s("a", 3.0, 80, 9400 if field == "xacts" else 90))
    r = snap_at(tr, 3.0).instances["a"]
    assert r.tps == pytest.approx(50.0)
    assert r.qps == pytest.approx(100.0 if field == "xacts" else 50.0)


def test_failover_to_higher_counters_is_caught_by_epoch() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 1000, epoch="old"))
    tr.observe(s("a", 1.0, 1100, epoch="old"))
    # The promoted standby has *higher* counters: only the epoch change tells it apart.
    tr.observe(s("a", 2.0, 9_000_000, epoch="new"))
    assert snap_at(tr, 2.0).instances["a"].tps == 0.0
    tr.observe(s("a", 3.0, 9_000_070, epoch="new"))
    assert snap_at(tr, 3.0).instances["a"].tps == pytest.approx(70.0)


def test_calls_reset_alone_only_zeroes_qps() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 100, 1000))
    tr.observe(s("a", 1.0, 200, 50))  # pg_stat_statements_reset()
    r = snap_at(tr, 1.0).instances["a"]
    assert r.tps == pytest.approx(100.0)
    assert r.qps == 0.0


def test_gap_longer_than_max_gap_rebaselines() -> None:
    tr = RateTracker(max_gap_s=5.0)
    tr.observe(s("a", 0.0, 0, 0))
    tr.observe(s("a", 1.0, 100, 100))
    # Paused for 30 s, then 3000 xacts: neither 3000/30 smeared nor a 3000/1 spike.
    tr.observe(s("a", 31.0, 3100, 3100))
    r = snap_at(tr, 31.0).instances["a"]
    assert r.tps == 0.0 and not r.has_rate
    tr.observe(s("a", 32.0, 3150, 3180))
    r = snap_at(tr, 32.0).instances["a"]
    assert r.tps == pytest.approx(50.0)
    assert r.qps == pytest.approx(80.0)


def test_gap_of_exactly_max_gap_still_counts() -> None:
    tr = RateTracker(max_gap_s=5.0)
    tr.observe(s("a", 0.0, 0))
    tr.observe(s("a", 5.0, 500))
    assert snap_at(tr, 5.0).instances["a"].tps == pytest.approx(100.0)


@pytest.mark.parametrize("dt", [0.0, -0.5])
def test_non_positive_dt_is_ignored(dt: float) -> None:
    tr = RateTracker()
    tr.observe(s("a", 10.0, 0, 0))
    tr.observe(s("a", 11.0, 100, 100))
    tr.observe(s("a", 11.0 + dt, 10_000, 10_000))
    r = snap_at(tr, 11.0).instances["a"]
    assert r.tps == pytest.approx(100.0)
    # The ignored sample did not become the baseline either.
    tr.observe(s("a", 12.0, 200, 200))
    assert snap_at(tr, 12.0).instances["a"].tps == pytest.approx(100.0)


def test_missing_pg_stat_statements_gives_none_qps_and_is_left_out_of_aggregate() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 0, None))
    tr.observe(s("b", 0.0, 0, 0))
    assert snap_at(tr, 0.0).instances["a"].qps is None
    tr.observe(s("a", 1.0, 10, None))
    tr.observe(s("b", 1.0, 20, 30))
    snap = snap_at(tr, 1.0)
    assert snap.instances["a"].qps is None
    assert snap.instances["a"].tps == pytest.approx(10.0)
    assert snap.aggregate_tps == pytest.approx(30.0)
    assert snap.aggregate_qps == pytest.approx(30.0)
    # Extension installed later: first interval with calls on one side only has no qps.
    tr.observe(s("a", 2.0, 20, 7))
    assert snap_at(tr, 2.0).instances["a"].qps is None
    tr.observe(s("a", 3.0, 30, 12))
    assert snap_at(tr, 3.0).instances["a"].qps == pytest.approx(5.0)


def test_replay_lag_is_the_latest_gauge() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 0, lag=None))
    tr.observe(s("a", 1.0, 1, lag=4096))
    assert snap_at(tr, 1.0).instances["a"].replay_lag_bytes == 4096
    tr.observe(s("a", 2.0, 0, lag=8192))  # even on a reset
    assert snap_at(tr, 2.0).instances["a"].replay_lag_bytes == 8192


def test_stale_instance_contributes_nothing() -> None:
    tr = RateTracker(max_gap_s=5.0)
    tr.observe(s("a", 0.0, 0, 0))
    tr.observe(s("a", 1.0, 100, 100))
    tr.observe(s("b", 0.0, 0, 0))
    tr.observe(s("b", 1.0, 10, 10))
    assert snap_at(tr, 6.0).aggregate_tps == pytest.approx(110.0)
    tr.observe(s("b", 7.0, 20, 20))  # 'a' stops answering
    snap = snap_at(tr, 7.0)
    assert snap.instances["a"].tps == 0.0
    assert not snap.instances["a"].has_rate
    assert snap.aggregate_tps == pytest.approx(snap.instances["b"].tps)


def test_aggregate_sums_and_window_is_mean_interval() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 0, 0))
    tr.observe(s("b", 0.0, 0, 0))
    tr.observe(s("c", 0.5, 0, 0))
    tr.observe(s("a", 1.0, 100, 300))
    tr.observe(s("b", 2.0, 100, 100))
    snap = snap_at(tr, 2.0)
    assert snap.aggregate_tps == pytest.approx(100.0 + 50.0)
    assert snap.aggregate_qps == pytest.approx(300.0 + 50.0)
    # 'c' has no rate yet, so only a's 1 s and b's 2 s intervals count.
    assert snap.window_s == pytest.approx(1.5)
    assert snap.at == pytest.approx(1_000_002.0)


def test_snapshot_instances_are_read_only() -> None:
    tr = RateTracker()
    tr.observe(s("a", 0.0, 0))
    snap = snap_at(tr, 0.0)
    with pytest.raises(TypeError):
        snap.instances["x"] = InstanceRate(0.0, None, None, 0.0)  # type: ignore[index]


def test_history_is_bounded_oldest_first_and_windowed() -> None:
    wall = FakeWall(2_000_000.0)
    tr = RateTracker(history_seconds=10, wall_clock=wall)
    for i in range(50):
        wall.now = 2_000_000.0 + i
        tr.observe(s("a", float(i), 10 * i, 0, wall=wall.now))
        tr.record()
    full = tr.history(10_000)
    # Bounded ring that still holds at least history_seconds one-second snapshots.
    assert 11 <= len(full) <= 12
    assert [h.at for h in full] == sorted(h.at for h in full)
    assert full[-1].at == 2_000_049.0
    last5 = tr.history(5)
    assert [h.at for h in last5] == [2_000_000.0 + i for i in range(44, 50)]
    assert all(h.aggregate_tps == pytest.approx(10.0) for h in last5)
    assert tr.history(0) == [full[-1]]


def test_history_empty_and_record_returns_snapshot() -> None:
    wall = FakeWall()
    tr = RateTracker(wall_clock=wall)
    assert tr.history(60) == []
    snap = tr.record()
    assert snap.at == wall.now
    assert snap.instances == {}
    assert tr.history(60) == [snap]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RateTracker(history_seconds=0)
    with pytest.raises(ValueError):
        RateTracker(max_gap_s=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.floats(min_value=-1.0, max_value=8.0, allow_nan=False),
            st.integers(min_value=0, max_value=10**12),
            st.one_of(st.none(), st.integers(min_value=0, max_value=10**12)),
            st.sampled_from(["e1", "e2"]),
        ),
        max_size=60,
    )
)
def test_rates_are_never_negative_and_aggregate_is_the_sum(
    steps: list[tuple[str, float, int, int | None, str]],
) -> None:
    tr = RateTracker(max_gap_s=5.0)
    clock = {"a": 0.0, "b": 0.0, "c": 0.0}
    now = 0.0
    for name, dt, xacts, calls, epoch in steps:
        clock[name] += dt
        now = max(now, clock[name])
        tr.observe(s(name, clock[name], xacts, calls, epoch=epoch))
        snap = snap_at(tr, now)
        for r in snap.instances.values():
            assert r.tps >= 0.0
            assert r.qps is None or r.qps >= 0.0
        assert snap.aggregate_tps == pytest.approx(sum(r.tps for r in snap.instances.values()))
        assert snap.aggregate_qps == pytest.approx(sum(r.qps for r in snap.instances.values() if r.qps is not None))
        assert snap.window_s >= 0.0


def test_totals_count_each_transaction_once_when_a_poll_is_late() -> None:
    """Rates integrated over snapshots count a late poll's interval twice; totals never do."""
    wall = FakeWall(1_000_000.0)
    tr = RateTracker(wall_clock=wall)
    tr.observe(s("a", 0.0, 1000, 0))
    tr.observe(s("b", 0.0, 5000, 0))
    start = tr.record()
    wall.now += 1
    tr.observe(s("a", 1.0, 1020, 20))
    tr.observe(s("b", 1.0, 5010, 10))
    points = [tr.record()]
    # Round 2: a's poll is late (not observed), its 20 TPS stands in this snapshot.
    wall.now += 1
    tr.observe(s("b", 2.0, 5020, 20))
    points.append(tr.record())
    # Round 3: a's late poll covers two seconds.
    wall.now += 1
    tr.observe(s("a", 3.0, 1060, 60))
    tr.observe(s("b", 3.0, 5030, 30))
    points.append(tr.record())
    assert points[-1].xacts_total - start.xacts_total == 60 + 30
    assert points[-1].statements_total - start.statements_total == 60 + 30
    integral = sum(p.aggregate_tps * p.window_s for p in points)
    assert integral > 90  # the double count the totals avoid


def test_totals_keep_a_gap_on_the_same_server_but_not_a_reset_or_another_server() -> None:
    tr = RateTracker(max_gap_s=5.0)
    tr.observe(s("a", 0.0, 100, 10))
    tr.observe(s("a", 60.0, 400, 40))  # a 60 s gap: no rate, but the 300 happened
    snap = snap_at(tr, 60.0)
    assert not snap.instances["a"].has_rate
    assert snap.xacts_total == 300 and snap.statements_total == 30
    tr.observe(s("a", 61.0, 50, 5))  # counters went down (stats reset): nothing counted
    tr.observe(s("a", 62.0, 70, 6, epoch="e2"))  # another server (failover): nothing counted
    tr.observe(s("a", 63.0, 75, 7, epoch="e2"))
    assert snap_at(tr, 63.0).xacts_total == 300 + 5
    assert snap_at(tr, 63.0).statements_total == 30 + 1
    tr.forget("a")  # an instance that leaves keeps what it counted in the totals
    assert snap_at(tr, 63.0).xacts_total == 305


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.floats(min_value=0.1, max_value=12.0),
                  st.integers(min_value=0, max_value=500), st.booleans()),
        max_size=50,
    )
)
def test_totals_are_the_sum_of_every_increase_whatever_the_timing(
    steps: list[tuple[str, float, int, bool]],
) -> None:
    """Totals = the sum of counter increases on each server, whatever the gaps and skipped rounds."""
    tr = RateTracker(max_gap_s=5.0)
    clock = {"a": 0.0, "b": 0.0}
    counter = {"a": 0, "b": 0}
    seen: set[str] = set()
    expected = 0
    for name, dt, grow, record in steps:
        clock[name] += dt
        counter[name] += grow
        if name in seen:
            expected += grow
        seen.add(name)
        tr.observe(s(name, clock[name], counter[name], counter[name]))
        if record:
            tr.record()
    snap = tr.snapshot()
    assert snap.xacts_total == expected
    assert snap.statements_total == expected


def test_each_instance_says_when_it_was_last_sampled() -> None:
    """A primary whose polls fail keeps its last sample's time: a count over a window is
    complete for it only up to then (cli/client.py waits for a newer one)."""
    tr = RateTracker(max_gap_s=5.0)
    tr.observe(s("a", 0.0, 100))
    tr.observe(s("b", 0.0, 100))
    tr.observe(s("a", 1.0, 110))
    tr.observe(s("b", 1.0, 120))
    tr.observe(s("a", 2.0, 130))  # b's poll failed
    snap = snap_at(tr, 2.0)
    assert snap.instances["a"].sampled_at == 1_000_002.0
    assert snap.instances["b"].sampled_at == 1_000_001.0
    stale = snap_at(tr, 9.0)  # b has had no sample for longer than max_gap_s: no rate, same time
    assert not stale.instances["b"].has_rate and stale.instances["b"].sampled_at == 1_000_001.0
