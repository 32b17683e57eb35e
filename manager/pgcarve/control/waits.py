"""What each primary's client sessions wait on, sampled live: the breakdown behind
``GET /v1/instances/{name}/waits``, the dashboard's "what commits wait on" and the benchmark's
report of every case.

The experiment behind pgcarve found its wall with perf: committing backends waited for the
synchronous standby (SyncRep) while the CPUs sat idle and the kernel spent its time on one mutex.
Sampling ``pg_stat_activity`` often shows the PostgreSQL side of that picture without perf: the
share of client-session time spent waiting for the standby, writing or inserting WAL, on other
lightweight locks, on other processes, on the client, or running.

Each primary gets a session of its own (``application_name=pgcarve-waits``) in pgcarve's own
database, so its statements never count as client transactions (control/collector.py), sampled
about ``rate_hz`` times a second; with many primaries less often, so the sampler sends at most
``max_per_s`` statements a second in all. A slow or unreachable primary only delays its own
samples. Each instance keeps the samples of the last ``window_s`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import psycopg
from psycopg.conninfo import make_conninfo

from pgcarve.control.collector import APPLICATION_NAME as COLLECTOR_NAME
from pgcarve.control.collector import Target
from pgcarve.postgres.session import MANAGER_DATABASE, first_line
from pgcarve.postgres.statistics import WAIT_CATEGORIES, WAIT_MEANING, wait_counts, waits_statement

log = logging.getLogger(__name__)

APPLICATION_NAME = "pgcarve-waits"
_RECONNECT_S = 2.0


@dataclass(frozen=True)
class WaitBreakdown:
    """Where an instance's client sessions were, over the samples of a window.

    ``shares`` has every WAIT_CATEGORIES entry (0.0 when never seen): the fraction of sampled
    session observations in it. ``sessions`` counts observations (sessions x samples).
    """

    instance: str
    samples: int
    sessions: int
    window_s: float
    shares: Mapping[str, float]
    error: str | None = None
    span_s: float | None = None  # from the oldest sample kept to now (None: the whole window)

    @property
    def dominant(self) -> str | None:
        """The category with the largest share, if anything was sampled."""
        return max(WAIT_CATEGORIES, key=lambda c: self.shares[c]) if self.sessions else None

    def summary(self) -> str:
        """One sentence for an operator."""
        if self.error and not self.samples:
            return f"not sampled: {self.error}"
        if not self.sessions:
            return "no client session in the samples" if self.samples else "no sample yet"
        top = self.dominant
        assert top is not None
        line = (f"{self.shares[top] * 100:.0f}% of sampled client-session time: {top} "
                f"({WAIT_MEANING[top]}); SyncRep {self.shares['SyncRep'] * 100:.0f}%")
        # The span really covered: on demand, sampling may have begun only seconds ago.
        span = self.window_s if self.span_s is None else self.span_s
        plural = "s" if self.samples != 1 else ""
        return line + f", over {self.samples} sample{plural} in {span:.{0 if span >= 10 else 1}f} s"


def breakdown_of(instance: str, samples: Sequence[Mapping[str, int]], window_s: float,
                 error: str | None = None, span_s: float | None = None) -> WaitBreakdown:
    """Shares of each category over `samples` (sessions per category, one mapping per sample),
    which cover the last `span_s` seconds (None: all of `window_s`)."""
    totals = dict.fromkeys(WAIT_CATEGORIES, 0)
    for sample in samples:
        for category, count in sample.items():
            totals[category] = totals.get(category, 0) + count
    sessions = sum(totals.values())
    shares = {c: (totals[c] / sessions if sessions else 0.0) for c in WAIT_CATEGORIES}
    return WaitBreakdown(instance=instance, samples=len(samples), sessions=sessions, window_s=window_s,
                         shares=MappingProxyType(shares), error=error, span_s=span_s)


@dataclass
class _Feed:
    """One instance's session, samples and sampling task."""

    target: Target
    interval_s: float
    samples: deque[tuple[float, dict[str, int]]] = field(default_factory=deque)
    conn: psycopg.AsyncConnection[tuple[object, ...]] | None = None
    error: str | None = None
    task: asyncio.Task[None] | None = None


class WaitSampler:
    """Samples every target's pg_stat_activity into a rolling window per instance."""

    def __init__(self, targets: Callable[[], Sequence[Target]], *, rate_hz: float = 10.0, max_per_s: float = 100.0,
                 window_s: float = 30.0, timeout_s: float = 3.0, on_demand_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_demand_s`: sample an instance only while someone asked for its breakdown within
        that many seconds (the API: a query several times a second costs a busy or emulated
        guest real CPU, so nobody watching means no sampling); None: sample every target."""
        if rate_hz <= 0 or max_per_s <= 0 or window_s <= 0:
            raise ValueError("rate_hz, max_per_s and window_s must be positive")
        if on_demand_s is not None and on_demand_s <= 0:
            raise ValueError("on_demand_s must be positive")
        self.on_demand_s = on_demand_s
        self._wanted: dict[str, float] = {}  # instance -> until when it is sampled (on demand)
        self._targets = targets
        self.rate_hz = rate_hz
        self.max_per_s = max_per_s
        self.window_s = window_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}

    def interval_s(self, targets: int) -> float:
        """Seconds between two samples of one target when there are `targets` of them."""
        return max(1.0 / self.rate_hz, targets / self.max_per_s)

    def watch(self, instance: str) -> None:
        """Someone wants the instance's breakdown: on demand, keep (or start) sampling it."""
        if self.on_demand_s is not None:
            self._wanted[instance] = self._clock() + self.on_demand_s

    def breakdown(self, instance: str) -> WaitBreakdown | None:
        """The instance's breakdown over the window; None if it is not sampled (yet: on demand,
        asking starts it)."""
        self.watch(instance)
        feed = self._feeds.get(instance)
        if feed is None:
            return None
        now = self._clock()
        recent = [(at, counts) for at, counts in list(feed.samples) if at >= now - self.window_s]
        span = now - recent[0][0] if recent else 0.0
        return breakdown_of(instance, [counts for _, counts in recent], self.window_s, feed.error, span)

    def breakdowns(self) -> dict[str, WaitBreakdown]:
        return {name: b for name in list(self._feeds) if (b := self.breakdown(name)) is not None}

    async def run(self, stop: asyncio.Event, reconcile_s: float = 1.0) -> None:
        """Sample until `stop` is set, following the target list every `reconcile_s`."""
        try:
            while not stop.is_set():
                try:
                    await self._reconcile()
                except Exception:
                    # Beside the TPS collector in one task group: a failure here must not stop it.
                    log.exception("could not update the list of primaries sampled for waits; retrying")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=reconcile_s)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for name in list(self._feeds):
            await self._drop(name)

    async def _reconcile(self) -> None:
        now = self._clock()
        self._wanted = {name: until for name, until in self._wanted.items() if until > now}
        current = {t.instance: t for t in self._targets() if self.on_demand_s is None or t.instance in self._wanted}
        for name in [n for n in self._feeds if n not in current or self._feeds[n].target != current[n]]:
            await self._drop(name)
        interval = self.interval_s(len(current))
        for name, target in current.items():
            feed = self._feeds.get(name)
            if feed is None:
                feed = _Feed(target, interval, deque(maxlen=math.ceil(self.window_s * self.rate_hz) + 1))
                feed.task = asyncio.create_task(self._sample_loop(feed), name=f"pgcarve-waits {name}")
                self._feeds[name] = feed
            feed.interval_s = interval

    async def _drop(self, name: str) -> None:
        """Stop sampling `name` and close its session before returning."""
        feed = self._feeds.get(name)
        if feed is None:
            return
        if feed.task is not None:
            feed.task.cancel()
            # Its finally closes the session. wait() neither raises the task's outcome nor
            # swallows our own cancellation; the feed stays listed until then, so an aclose()
            # after our cancellation still waits for it.
            await asyncio.wait({feed.task})
        self._feeds.pop(name, None)

    async def _sample_loop(self, feed: _Feed) -> None:
        next_at = self._clock()
        try:
            while True:
                try:
                    await self.sample(feed)
                except Exception as exc:
                    # Anything (a refused login, an odd row, a driver bug) ends in a new session
                    # on a later tick: a dead task would leave the instance unsampled for good.
                    known = isinstance(exc, _SampleError)
                    message = (str(exc) if known
                               else f"sampling PostgreSQL on {feed.target.host} failed: {first_line(exc)}")
                    if feed.error != message:  # once per new error, with the trace if unforeseen
                        log.log(logging.INFO if known else logging.WARNING, "%s: %s; trying again in %g s",
                                feed.target.instance, message, _RECONNECT_S, exc_info=not known)
                    feed.error = message
                    await self._close(feed)
                    await asyncio.sleep(_RECONNECT_S)
                    next_at = self._clock()
                    continue
                step = feed.interval_s
                next_at += step
                now = self._clock()
                if next_at <= now:  # a slow sample: skip the missed ticks, never bunch them
                    next_at = now + step - (now - next_at) % step
                await asyncio.sleep(next_at - now)
        finally:
            await self._close(feed)

    async def sample(self, feed: _Feed) -> None:
        """One sample of one target (connecting first if needed)."""
        if feed.conn is None or feed.conn.closed:
            feed.conn = await self._connect(feed.target)
        try:
            async with asyncio.timeout(self.timeout_s):
                cur = await feed.conn.execute(waits_statement(), {"exclude": [APPLICATION_NAME, COLLECTOR_NAME]})
                rows = await cur.fetchall()
        except TimeoutError as exc:
            raise _SampleError(f"no answer within {self.timeout_s:g} s") from exc
        except psycopg.Error as exc:
            raise _SampleError(f"sampling pg_stat_activity failed: {first_line(exc)}") from exc
        feed.samples.append((self._clock(), wait_counts(rows)))
        feed.error = None

    async def _connect(self, target: Target) -> psycopg.AsyncConnection[tuple[object, ...]]:
        """A session in pgcarve's own database, so its statements are not client work; in the
        target's own database on a server without one (an image older than it)."""

        async def connect(database: str | None = None) -> psycopg.AsyncConnection[tuple[object, ...]]:
            dsn = target.dsn if database is None else make_conninfo(target.dsn, dbname=database)
            return await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, prepare_threshold=None, application_name=APPLICATION_NAME,
                connect_timeout=max(2, math.ceil(self.timeout_s)))

        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    return await connect(MANAGER_DATABASE)
                except psycopg.OperationalError as exc:
                    # libpq reports a refused login without a SQLSTATE: only its text says why.
                    if f'database "{MANAGER_DATABASE}" does not exist' not in str(exc):
                        raise
                    return await connect()
        except TimeoutError as exc:
            raise _SampleError(f"cannot connect to PostgreSQL on {target.host}: no answer") from exc
        except psycopg.Error as exc:
            raise _SampleError(f"cannot connect to PostgreSQL on {target.host}: {first_line(exc)}") from exc

    @staticmethod
    async def _close(feed: _Feed) -> None:
        conn, feed.conn = feed.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


class _SampleError(Exception):
    """A sample failed; the message is in operator words."""
