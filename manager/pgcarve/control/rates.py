"""Turn per-instance PostgreSQL counters into TPS/QPS rates and an aggregate history.

Pure arithmetic: no I/O, no clocks except the wall clock used to stamp snapshots when the
caller passes none. The collector feeds one :class:`Sample` per instance per poll round to a
:class:`RateTracker`, then calls :meth:`RateTracker.record` once per round.

Rules, in the order :meth:`RateTracker.observe` applies them:

* rate = counter delta / monotonic-time delta between two consecutive samples of one instance;
* a sample whose monotonic time is not after the previous one (dt <= 0) is ignored entirely;
* the first sample of an instance (it joined) is only a baseline: the instance is listed with
  ``tps=0.0`` (``qps=0.0``, or ``None`` without pg_stat_statements) and ``interval_s=0.0``
  (``InstanceRate.has_rate`` is False) until its second sample, so a joining instance never
  adds a spike of its whole counter to the aggregate;
* a gap longer than ``max_gap_s`` (missed polls, paused guest), a counter that went down
  (stats reset, restart, failover to a standby with other counters) or a new server
  ``epoch`` re-baselines the instance: that interval reports 0, never a negative rate, a spike
  or an average smeared over the outage;
* ``calls is None`` (pg_stat_statements missing) gives ``qps=None`` for that instance, and the
  instance is left out of ``aggregate_qps``; a reset of ``calls`` alone only zeroes ``qps``;
* an instance whose latest sample is older than ``max_gap_s`` at snapshot time (its polls are
  failing) is listed with zero rates: a stale rate must not keep inflating the aggregate;
* :meth:`RateTracker.forget` drops an instance (scaled down) from the aggregate at once.

Rates are for watching; counts over a window come from totals. Each snapshot carries
``xacts_total`` and ``statements_total``: every client transaction and statement the tracker
has seen counted since it started, summed over instances (those that left included). The
difference of two snapshots' totals is exactly what PostgreSQL counted in between, whatever
the polls did: a poll that arrives late leaves the previous rate standing in one snapshot
(so summing ``aggregate_tps x window_s`` counts that interval twice), but every counter delta
is added to the totals once. A gap over ``max_gap_s`` zeroes the rate, yet its delta still
counts when the server (``epoch``) is the same and the counter did not go down.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Sample:
    """Counters read from one instance in one poll.

    ``monotonic`` is when the counters were read (the collector uses the midpoint of the query's
    round trip); ``wall`` is the same moment on the wall clock. ``xacts`` counts what clients
    did: xact_commit + xact_rollback in the databases clients use, with background work
    (autovacuum) and pgcarve's own sessions taken out; ``calls`` the clients' pg_stat_statements
    calls (None when the extension is missing). Rates and totals are computed from these two.
    ``all_xacts`` / ``all_calls`` are everything PostgreSQL counted, only the collector's own
    statements taken out (None: same as the client figures). ``epoch`` identifies the server
    process that owns the counters (e.g. its postmaster start time); a change re-baselines.
    """

    instance: str
    monotonic: float
    wall: float
    xacts: int
    calls: int | None
    replay_lag_bytes: int | None
    epoch: str = ""
    all_xacts: int | None = None
    all_calls: int | None = None


@dataclass(frozen=True)
class InstanceRate:
    """Latest rates of one instance; ``interval_s`` is 0.0 when there is no rate yet."""

    tps: float
    qps: float | None
    replay_lag_bytes: int | None
    interval_s: float
    # Wall time of the sample these come from: a window's count is complete for an instance
    # only up to here (a primary too busy to answer the collector has an older one).
    sampled_at: float = 0.0

    @property
    def has_rate(self) -> bool:
        """True when ``tps`` was measured over an interval (not a join, reset or gap)."""
        return self.interval_s > 0.0


@dataclass(frozen=True)
class Snapshot:
    """Aggregate view at wall time ``at``.

    ``window_s`` is the mean interval of the instance rates used (0.0 when none has a rate).
    ``xacts_total`` / ``statements_total``: client transactions and statements counted since
    the tracker started (see the module docstring); subtract two snapshots' to count a window.
    """

    at: float
    window_s: float
    aggregate_tps: float
    aggregate_qps: float
    instances: Mapping[str, InstanceRate]
    xacts_total: int = 0
    statements_total: int = 0


@dataclass
class _State:
    """What the tracker remembers of one instance."""

    baseline: Sample
    rate: InstanceRate


def _no_rate(sample: Sample) -> InstanceRate:
    # qps keeps None-ness so a missing extension stays visible even without a rate.
    return InstanceRate(
        tps=0.0,
        qps=None if sample.calls is None else 0.0,
        replay_lag_bytes=sample.replay_lag_bytes,
        interval_s=0.0,
        sampled_at=sample.wall,
    )


class RateTracker:
    """Per-instance rates from consecutive samples, their aggregate and a bounded history."""

    def __init__(
        self,
        history_seconds: int = 3600,
        max_gap_s: float = 5.0,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Keep ``history_seconds`` 1-second snapshots; re-baseline after gaps over ``max_gap_s``."""
        if history_seconds < 1:
            raise ValueError("history_seconds must be at least 1")
        if max_gap_s <= 0:
            raise ValueError("max_gap_s must be positive")
        self.max_gap_s = max_gap_s
        self._wall_clock = wall_clock
        self._states: dict[str, _State] = {}
        self._xacts_total = 0
        self._statements_total = 0
        # One snapshot per poll round at 1 Hz; a small margin so `history(history_seconds)` is
        # full even when a round lands a little early.
        self._history: deque[Snapshot] = deque(maxlen=history_seconds + 2)

    def observe(self, sample: Sample) -> None:
        """Update one instance with a new sample (see the module docstring for the rules)."""
        state = self._states.get(sample.instance)
        if state is None:
            self._states[sample.instance] = _State(sample, _no_rate(sample))
            return
        prev = state.baseline
        dt = sample.monotonic - prev.monotonic
        if dt <= 0.0:
            # Out of order or duplicate: nothing to learn, and dividing by it would explode.
            return
        state.baseline = sample
        same_server = sample.epoch == prev.epoch
        if same_server and sample.xacts >= prev.xacts:
            # Counted once, whether or not this interval gets a rate (gaps included).
            self._xacts_total += sample.xacts - prev.xacts
            if sample.calls is not None and prev.calls is not None and sample.calls >= prev.calls:
                self._statements_total += sample.calls - prev.calls
        if dt > self.max_gap_s or not same_server or sample.xacts < prev.xacts:
            state.rate = _no_rate(sample)
            return
        qps: float | None
        if sample.calls is None or prev.calls is None:
            qps = None
        elif sample.calls < prev.calls:
            # pg_stat_statements_reset() or evicted entries: only qps loses this interval.
            qps = 0.0
        else:
            qps = (sample.calls - prev.calls) / dt
        state.rate = InstanceRate(
            tps=(sample.xacts - prev.xacts) / dt,
            qps=qps,
            replay_lag_bytes=sample.replay_lag_bytes,
            interval_s=dt,
            sampled_at=sample.wall,
        )

    def forget(self, instance: str) -> None:
        """Drop an instance that left; it no longer counts in any later snapshot."""
        self._states.pop(instance, None)

    def instances(self) -> list[str]:
        """Names of the instances currently tracked."""
        return list(self._states)

    def snapshot(self, now_wall: float | None = None) -> Snapshot:
        """Latest rate of every current instance and their sums, stamped ``now_wall``."""
        at = self._wall_clock() if now_wall is None else now_wall
        rates: dict[str, InstanceRate] = {}
        tps_sum = 0.0
        qps_sum = 0.0
        intervals: list[float] = []
        for name, state in self._states.items():
            rate = state.rate
            if at - state.baseline.wall > self.max_gap_s:
                # Polls of this instance stopped succeeding: report nothing rather than the past.
                rate = _no_rate(state.baseline)
            rates[name] = rate
            if rate.has_rate:
                tps_sum += rate.tps
                intervals.append(rate.interval_s)
            if rate.qps is not None:
                qps_sum += rate.qps
        window = sum(intervals) / len(intervals) if intervals else 0.0
        return Snapshot(
            at=at,
            window_s=window,
            aggregate_tps=tps_sum,
            aggregate_qps=qps_sum,
            instances=MappingProxyType(rates),
            xacts_total=self._xacts_total,
            statements_total=self._statements_total,
        )

    def record(self) -> Snapshot:
        """Take a snapshot now and append it to the history (once per poll round)."""
        snap = self.snapshot()
        self._history.append(snap)
        return snap

    def history(self, seconds: float) -> list[Snapshot]:
        """Recorded snapshots, oldest first, at most ``seconds`` older than the newest one."""
        if not self._history:
            return []
        cutoff = self._history[-1].at - seconds
        # Walk back from the newest: the deque is in recording order.
        out: list[Snapshot] = []
        for snap in reversed(self._history):
            if snap.at < cutoff:
                break
            out.append(snap)
        out.reverse()
        return out
