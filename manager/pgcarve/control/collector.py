"""Poll every instance's PostgreSQL for transaction/statement counters and replication state.

One persistent autocommit connection per target (``application_name=pgcarve-collector``),
one round trip per target per poll, all targets polled concurrently. Samples go to a
:class:`~pgcarve.control.rates.RateTracker`, which turns them into TPS/QPS. A round waits for its
polls at most ``round_timeout_s``; a slower poll (unreachable host, paused guest) finishes in
the background and is used by a later round, so one bad target never slows the others.

TPS and QPS count what clients do. Three kinds of work PostgreSQL counts too are taken out:

* pgcarve's own sessions (readiness checks, slots, failover, scale-down) log in to a database of
  their own, ``pgcarve`` (MANAGER_DATABASE), and template databases are autovacuum's alone: only
  the other databases count as client work. Statements likewise (pg_stat_statements' dbid).
* autovacuum in the database the collector polls: PostgreSQL 15 counts one transaction per table
  a worker processes, one per vacuum and one per analyze of it, and two per worker visit to a
  database (its start-up and its last transaction); measured on PostgreSQL 15 against
  log_autovacuum_min_duration. The poll reads the tables' autovacuum/autoanalyze counts and
  timestamps and the workers running now, and the collector subtracts those transactions. A
  worker's counts land in pg_stat_database when it exits, after its table counts: the client
  counter is held (never lowered) until they arrive. Not seen: a visit that found no work and
  ran between two polls (2 transactions, at most once per autovacuum_naptime per database), and
  autovacuum in client databases other than the one polled.
* the collector's own statements, in the database it polls, as follows (an idle instance reads
  exactly 0 TPS and 0 QPS; checked against real servers in
  tests/integration/test_collector_local.py):

* **xacts**: every statement the collector sends in autocommit is one transaction
  (xact_commit, or xact_rollback if it fails), and so is the start of each session (the
  backend's startup transaction); measured on PostgreSQL 15: +1 per session, +1 per
  statement. The collector counts these per instance and subtracts those made *before* the
  current statement (the statement reading the counters is not in them yet). A statement
  whose session was lost or that timed out is not counted: if it did run, one transaction
  shows up as workload once, whereas over-counting would make the counter go down (a fake
  reset). On PostgreSQL 15+ every collector statement calls ``pg_stat_force_next_flush()``
  so the backend publishes its own counts as soon as it goes idle rather than up to a second
  later (PGSTAT_MIN_INTERVAL); otherwise the subtraction would run ahead of the published
  counter whenever polls are closer than a second. psycopg's automatic server-side prepare is
  off: its extra Parse round trip is one more transaction, on the 5th execution only.
* **calls**: pg_stat_statements counts the collector's poll too. The poll leaves out the entry
  whose queryid is its own (``pg_stat_get_activity(pg_backend_pid()).query_id``): no
  bookkeeping, and it survives entry eviction. The extension check made once per
  (re)connection is still counted: one call per reconnection.
* Only this collector's own session is compensated: a second collector (or any other
  monitoring) polling the same server shows up as its ~1 TPS of workload.

Known limit: PostgreSQL 15 backends publish their transaction counts when idle and at most once
a second, so xact_commit lags the workload by up to ~1 s; per-interval TPS is shifted by that
much, while totals over any longer window are exact (pg_stat_statements calls are not delayed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import psycopg

from pgcarve.control.rates import RateTracker, Sample, Snapshot
from pgcarve.postgres.session import first_line
from pgcarve.postgres.statistics import (
    FORCE_FLUSH_VERSION,
    PollRow,
    StandbyState,
    check_statement,
    poll_statement,
)

log = logging.getLogger(__name__)

APPLICATION_NAME = "pgcarve-collector"

# A session's startup transaction counts in xact_commit like a statement does.
_STARTUP_XACTS = 1


@dataclass(frozen=True)
class Target:
    """One instance to poll: its name, the host it runs on (for messages) and its DSN."""

    instance: str
    host: str
    dsn: str


# Autovacuum transactions a worker visit costs besides its tables: its start-up and its last one.
_AUTOVACUUM_VISIT_XACTS = 2


@dataclass
class _Link:
    """Connection and compensation state of one instance."""

    target: Target
    conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
    poll_sql: Any = None  # postgres.statistics.poll_statement(...), chosen at (re)connection
    # Collector transactions on this server since the counter baseline (see module docstring).
    own_xacts: int = 0
    last_raw_xacts: int | None = None
    last_epoch: str | None = None
    # Autovacuum's transactions in the polled database since the baseline, and what the last
    # poll saw of it (operations so far, its newest autovacuum time and the one before, the
    # workers running then).
    background_xacts: int = 0
    autovacuum_ops: int | None = None
    autovacuum_mark: Any = None
    autovacuum_mark_before: Any = None
    autovacuum_workers: frozenset[int] = frozenset()
    charged_workers: frozenset[int] = frozenset()
    client_xacts: int | None = None  # the last client count handed out (never lowered)
    standbys: tuple[StandbyState, ...] = field(default_factory=tuple)
    sync_waiting: int = 0  # sessions stuck waiting for a synchronous standby at the last poll
    write_fence: str | None = None  # why the primary refused new writes at the last poll
    # The poll in flight; it may outlive a round (slow connect, hung guest) and is harvested later.
    task: asyncio.Task[Sample | str] | None = None


class _PollError(Exception):
    """A poll failed; the message is already in operator words.

    ``keep_connection`` is True when the session is still usable (the statement failed but the
    connection did not), so a persistent error does not turn into a reconnection every poll.
    """

    def __init__(self, message: str, keep_connection: bool = False) -> None:
        super().__init__(message)
        self.keep_connection = keep_connection


class Collector:
    """Polls targets, feeds a RateTracker, keeps per-instance errors and standby states."""

    def __init__(
        self,
        targets: Callable[[], Sequence[Target]],
        tracker: RateTracker,
        interval_s: float = 1.0,
        connect_timeout_s: float = 3.0,
        *,
        query_timeout_s: float | None = None,
        round_timeout_s: float | None = None,
    ) -> None:
        """Poll ``targets()`` every ``interval_s``.

        A query may take ``query_timeout_s`` (default ``connect_timeout_s``) before the
        connection is dropped and the poll counted as failed. A round waits at most
        ``round_timeout_s`` (default 0.9 x ``interval_s``) for its polls: one that takes longer
        (unreachable host, paused guest) goes on in the background and is used by a later
        round, so one bad target never slows the cadence of the others.
        """
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._targets = targets
        self.tracker = tracker
        self.interval_s = interval_s
        self.connect_timeout_s = connect_timeout_s
        self.query_timeout_s = connect_timeout_s if query_timeout_s is None else query_timeout_s
        self.round_timeout_s = 0.9 * interval_s if round_timeout_s is None else round_timeout_s
        self.on_sample: list[Callable[[Target, Sample], None]] = []
        self._links: dict[str, _Link] = {}
        self._errors: dict[str, str] = {}
        self._round = asyncio.Lock()
        self.rounds = 0  # poll rounds finished: what a round changed is new after this grows

    def last_errors(self) -> Mapping[str, str]:
        """Per instance, the last poll error in operator words; cleared by a successful poll."""
        return MappingProxyType(dict(self._errors))

    def replication(self, instance: str) -> list[StandbyState]:
        """Standbys seen by ``instance``'s last successful poll ([] if none or unknown)."""
        link = self._links.get(instance)
        return list(link.standbys) if link else []

    def commits_waiting(self, instance: str) -> int:
        """Sessions of ``instance`` whose commit had waited > 3 s for a synchronous standby at the last poll."""
        link = self._links.get(instance)
        return link.sync_waiting if link else 0

    def write_fence(self, instance: str) -> str | None:
        """Why the instance's primary refused new writes at the last poll (None: it did not)."""
        link = self._links.get(instance)
        return link.write_fence if link else None

    async def poll_once(self) -> Snapshot:
        """Poll every current target concurrently, update the tracker, record a snapshot.

        Never raises for a target's failure: the error is kept in :meth:`last_errors` and the
        target is reconnected on the next poll. A target whose poll is still running after
        ``round_timeout_s`` is left out of this round (its last rate stands until the tracker's
        ``max_gap_s`` makes it stale) and its result is taken by the next round.
        """
        async with self._round:
            # One link per instance name: a duplicate would poll one connection twice at once.
            current = {t.instance: t for t in self._targets()}
            targets = list(current.values())
            for instance in [name for name in self._links if name not in current]:
                await self._drop(instance)
            for instance in [name for name in self.tracker.instances() if name not in current]:
                self.tracker.forget(instance)
            for target in targets:
                link = self._links.get(target.instance)
                if link is not None and link.target != target:
                    # Moved to another DSN (e.g. failover): a different server, start over.
                    await self._drop(target.instance)
                    link = None
                if link is None:
                    self._links[target.instance] = _Link(target)
            links = [self._links[t.instance] for t in targets]
            for link in links:
                if link.task is None:
                    link.task = asyncio.create_task(self._poll(link))
            in_flight = {link.task for link in links if link.task is not None}
            if in_flight:
                await asyncio.wait(in_flight, timeout=self.round_timeout_s)
            for target, link in zip(targets, links, strict=True):
                task = link.task
                if task is None or not task.done():
                    continue
                link.task = None
                if task.cancelled():
                    continue
                # _poll turns every failure into a message, so result() does not raise.
                result = task.result()
                if isinstance(result, str):
                    if self._errors.get(target.instance) != result:
                        log.warning("%s: %s", target.instance, result)
                    self._errors[target.instance] = result
                    continue
                if self._errors.pop(target.instance, None) is not None:
                    log.info("%s: polling works again", target.instance)
                self.tracker.observe(result)
                for hook in list(self.on_sample):
                    try:
                        hook(target, result)
                    except Exception:
                        # A broken exporter must not stop the collection.
                        log.exception("on_sample hook failed for %s", target.instance)
            self.rounds += 1
            return self.tracker.record()

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every ``interval_s`` on a fixed monotonic schedule until ``stop`` is set.

        Ticks are ``start + k * interval_s``: a slow round delays nothing but itself, and a
        round longer than the interval skips the missed ticks instead of bunching polls.
        """
        next_tick = time.monotonic()
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception:
                log.exception("poll round failed")
            next_tick += self.interval_s
            now = time.monotonic()
            if next_tick <= now:
                next_tick += (math.floor((now - next_tick) / self.interval_s) + 1) * self.interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=next_tick - now)

    async def aclose(self) -> None:
        """Close every connection; the collector can still poll again afterwards."""
        async with self._round:
            for instance in list(self._links):
                await self._drop(instance)

    async def _drop(self, instance: str) -> None:
        """Forget a target's poll, connection and state (it left, or its DSN changed)."""
        link = self._links.pop(instance, None)
        self._errors.pop(instance, None)
        if link is None:
            return
        task, link.task = link.task, None
        if task is not None and not task.done():
            task.cancel()
            # wait() neither raises the task's outcome nor swallows our own cancellation.
            await asyncio.wait({task})
        await self._close(link)

    @staticmethod
    async def _close(link: _Link) -> None:
        conn, link.conn, link.poll_sql = link.conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _poll(self, link: _Link) -> Sample | str:
        """One poll of one target: a Sample, or an error message for the operator."""
        try:
            return await self._poll_or_raise(link)
        except _PollError as exc:
            if not exc.keep_connection:
                await self._close(link)
            return str(exc)
        except Exception as exc:
            # Anything unexpected (bad row, driver bug) still must not end the round.
            await self._close(link)
            return f"polling PostgreSQL on {link.target.host} failed: {first_line(exc)}"

    async def _poll_or_raise(self, link: _Link) -> Sample:
        host = link.target.host
        if link.conn is None or link.conn.closed or link.poll_sql is None:
            await self._connect(link)
        conn, poll_sql = link.conn, link.poll_sql
        assert conn is not None and poll_sql is not None
        own_before = link.own_xacts
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.query_timeout_s):
                cur = await conn.execute(
                    poll_sql, {"since": link.autovacuum_mark, "before": link.autovacuum_mark_before})
                row = await cur.fetchone()
        except TimeoutError as exc:
            # Not counted as ours: if it did run, one transaction shows up as workload once,
            # whereas over-counting would make the counter go down, i.e. a fake reset.
            raise _PollError(
                f"PostgreSQL on {host} did not answer the statistics query within {self.query_timeout_s:g} s"
            ) from exc
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                # The session was gone (terminated, server down): the statement never ran.
                raise _PollError(f"lost the connection to PostgreSQL on {host}: {first_line(exc)}") from exc
            link.own_xacts += 1  # it ran and rolled back: xact_rollback counts it
            raise _PollError(f"statistics query failed on {host}: {first_line(exc)}", keep_connection=True) from exc
        link.own_xacts += 1
        t1 = time.monotonic()
        wall = time.time() - (t1 - t0) / 2
        if row is None:
            raise _PollError(f"statistics query on {host} returned no row")
        polled = PollRow.parse(row)
        raw_xacts, epoch = polled.all_xacts, polled.epoch
        reset = link.last_raw_xacts is not None and (raw_xacts < link.last_raw_xacts or epoch != link.last_epoch)
        if reset:
            # Counters were reset or this is another server: our past statements are not in
            # them any more; the tracker re-baselines on the same signal.
            own_before = 0
            link.own_xacts = 1
            link.background_xacts, link.autovacuum_ops, link.client_xacts = 0, None, None
            link.autovacuum_workers = link.charged_workers = frozenset()
            link.autovacuum_mark = None
        link.last_raw_xacts, link.last_epoch = raw_xacts, epoch
        link.standbys = polled.standbys
        link.sync_waiting = polled.sync_waiting
        link.write_fence = polled.write_fence
        self._count_autovacuum(link, polled.autovacuum_ops, polled.autovacuum_tables, polled.autovacuum_workers)
        link.autovacuum_mark_before, link.autovacuum_mark = link.autovacuum_mark, polled.autovacuum_mark
        client_xacts = polled.client_xacts - own_before - link.background_xacts
        if link.client_xacts is not None and client_xacts < link.client_xacts:
            # Autovacuum's table counts arrive before its transactions: hold, never go down.
            client_xacts = link.client_xacts
        link.client_xacts = client_xacts
        return Sample(
            instance=link.target.instance,
            # Midpoint: the server read the counters somewhere inside the round trip.
            monotonic=(t0 + t1) / 2,
            wall=wall,
            xacts=client_xacts,
            calls=polled.client_calls,
            replay_lag_bytes=polled.replay_lag_bytes,
            epoch=epoch,
            all_xacts=raw_xacts - own_before,
            all_calls=polled.all_calls,
        )

    @staticmethod
    def _count_autovacuum(link: _Link, ops: int, tables: int, workers: frozenset[int]) -> None:
        """Add autovacuum's transactions since the previous poll to ``link.background_xacts``.

        Per table a worker finished: one transaction, plus one per vacuum and per analyze
        (``ops``). Per worker visit: two more, charged once per worker process seen (a long
        visit spans polls), or once for work done by a worker no poll saw running.
        """
        if link.autovacuum_ops is None:  # the baseline poll: nothing to compare with yet
            link.autovacuum_ops, link.autovacuum_workers = ops, workers
            link.charged_workers = workers  # already running: their start-up is in the baseline
            return
        new_ops = max(0, ops - link.autovacuum_ops)
        link.autovacuum_ops = ops
        xacts = new_ops + (max(tables, 1) if new_ops else 0)
        new_workers = workers - link.charged_workers
        xacts += _AUTOVACUUM_VISIT_XACTS * len(new_workers)
        if new_ops and not workers and not link.autovacuum_workers:
            xacts += _AUTOVACUUM_VISIT_XACTS  # a short visit between two polls
        link.charged_workers = (link.charged_workers & workers) | new_workers
        link.autovacuum_workers = workers
        link.background_xacts += xacts

    async def _connect(self, link: _Link) -> None:
        """Open the connection, check for pg_stat_statements and pick the poll statement."""
        await self._close(link)
        host = link.target.host
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                conn = await psycopg.AsyncConnection.connect(
                    link.target.dsn,
                    autocommit=True,
                    # Auto-prepare adds a Parse round trip, i.e. one uncounted transaction.
                    prepare_threshold=None,
                    application_name=APPLICATION_NAME,
                    connect_timeout=max(2, math.ceil(self.connect_timeout_s)),
                )
        except TimeoutError as exc:
            raise _PollError(
                f"cannot connect to PostgreSQL on {host}: no answer within {self.connect_timeout_s:g} s"
            ) from exc
        except psycopg.Error as exc:
            raise _PollError(f"cannot connect to PostgreSQL on {host}: {first_line(exc)}") from exc
        link.conn = conn
        link.own_xacts += _STARTUP_XACTS
        force_flush = conn.info.server_version >= FORCE_FLUSH_VERSION
        try:
            async with asyncio.timeout(self.query_timeout_s):
                cur = await conn.execute(check_statement(force_flush))
                row = await cur.fetchone()
        except TimeoutError as exc:
            raise _PollError(f"PostgreSQL on {host} did not answer within {self.query_timeout_s:g} s") from exc
        except psycopg.Error as exc:
            if not (conn.broken or conn.closed):
                link.own_xacts += 1
            raise _PollError(f"checking pg_stat_statements on {host} failed: {first_line(exc)}") from exc
        link.own_xacts += 1
        schema = row[0] if row is not None and row[1] else None
        link.poll_sql = poll_statement(schema, force_flush)
