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
from psycopg import sql

from pgcarve.control.rates import RateTracker, Sample, Snapshot
from pgcarve.guest.seed import MANAGER_DATABASE

log = logging.getLogger(__name__)

APPLICATION_NAME = "pgcarve-collector"

# A session's startup transaction counts in xact_commit like a statement does.
_STARTUP_XACTS = 1
# First PostgreSQL release with pg_stat_force_next_flush() (and shared-memory statistics).
_FORCE_FLUSH_VERSION = 150000


@dataclass(frozen=True)
class Target:
    """One instance to poll: its name, the host it runs on (for messages) and its DSN."""

    instance: str
    host: str
    dsn: str


@dataclass(frozen=True)
class StandbyState:
    """One row of pg_stat_replication on a primary, lags in seconds and bytes."""

    application_name: str
    client_addr: str | None
    state: str | None
    sync_state: str | None
    write_lag_s: float | None
    flush_lag_s: float | None
    replay_lag_s: float | None
    lag_bytes: int | None


_MARKER = sql.SQL("/* pgcarve-collector */ ")
_FORCE_FLUSH = sql.SQL(", pg_catalog.pg_stat_force_next_flush() IS NULL AS flushed")

_CHECK = sql.SQL(
    "SELECT (SELECT n.nspname FROM pg_catalog.pg_extension e"
    " JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace"
    " WHERE e.extname = 'pg_stat_statements') AS pgss_schema,"
    " 'pg_stat_statements' = ANY (pg_catalog.string_to_array(pg_catalog.replace("
    "pg_catalog.current_setting('shared_preload_libraries'), ' ', ''), ',')) AS pgss_loaded"
)

# pg_stat_statements(false): the view reads every query text from disk; the counters do not.
# Our own entry is the one whose queryid is that of the statement running in this backend.
# Databases whose work is the clients': not templates (autovacuum's only), not pgcarve's own.
_CLIENT_DATABASES = sql.SQL(
    "(SELECT db.oid FROM pg_catalog.pg_database db WHERE NOT db.datistemplate AND db.datname <> {manager})"
).format(manager=sql.Literal(MANAGER_DATABASE))
_CALLS = sql.SQL(
    "(SELECT pg_catalog.sum(s.calls) FROM {schema}.pg_stat_statements(false) s"
    " WHERE s.queryid IS DISTINCT FROM (SELECT a.query_id"
    " FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a))::bigint AS all_calls,"
    " (SELECT pg_catalog.sum(s.calls) FROM {schema}.pg_stat_statements(false) s"
    " WHERE s.dbid IN {client_databases} AND s.queryid IS DISTINCT FROM (SELECT a.query_id"
    " FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a))::bigint AS client_calls"
)
_NO_CALLS = sql.SQL("NULL::bigint AS all_calls, NULL::bigint AS client_calls")

# Lag bytes are measured against the current WAL position on a primary; a cascading standby
# cannot call pg_current_wal_lsn(), so its walsenders are measured against its replay position
# (and the instance's replay_lag_bytes gauge is NULL there, as on any server in recovery).
_POLL = sql.SQL(
    "WITH rep AS ("
    "SELECT r.application_name, r.client_addr::text AS client_addr, r.state, r.sync_state,"
    " extract(epoch FROM r.write_lag)::float8 AS write_lag_s,"
    " extract(epoch FROM r.flush_lag)::float8 AS flush_lag_s,"
    " extract(epoch FROM r.replay_lag)::float8 AS replay_lag_s,"
    " pg_catalog.pg_wal_lsn_diff(CASE WHEN pg_catalog.pg_is_in_recovery()"
    " THEN pg_catalog.pg_last_wal_replay_lsn() ELSE pg_catalog.pg_current_wal_lsn() END,"
    " r.replay_lsn)::bigint AS lag_bytes"
    " FROM pg_catalog.pg_stat_replication r) "
    "SELECT (SELECT pg_catalog.sum(d.xact_commit + d.xact_rollback)"
    " FROM pg_catalog.pg_stat_database d)::bigint AS all_xacts,"
    " (SELECT pg_catalog.sum(d.xact_commit + d.xact_rollback) FROM pg_catalog.pg_stat_database d"
    " WHERE d.datid IN {client_databases})::bigint AS client_xacts,"
    " {calls},"
    " CASE WHEN pg_catalog.pg_is_in_recovery() THEN NULL"
    " ELSE (SELECT pg_catalog.max(rep.lag_bytes) FROM rep) END AS replay_lag_bytes,"
    " (SELECT pg_catalog.json_agg(rep ORDER BY rep.application_name) FROM rep) AS standbys,"
    " pg_catalog.pg_postmaster_start_time()::text AS epoch,"
    # Sessions whose commit has waited over 3 s for a synchronous standby (a normal commit waits
    # milliseconds): pg_stat_replication can still list a dead standby as "sync" until
    # wal_sender_timeout; this cannot be fooled.
    " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_activity a"
    " WHERE a.wait_event = 'SyncRep' AND a.state_change < pg_catalog.now() - interval '3 seconds')::int"
    " AS sync_waiting,"
    # Autovacuum in this database (see the module docstring): operations so far, tables it
    # finished since the previous poll's clock, and the workers in here now.
    " (SELECT pg_catalog.sum(t.autovacuum_count + t.autoanalyze_count)"
    " FROM pg_catalog.pg_stat_all_tables t)::bigint AS autovacuum_ops,"
    " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_all_tables t"
    " WHERE GREATEST(t.last_autovacuum, t.last_autoanalyze) > {since})::int AS autovacuum_tables,"
    " (SELECT pg_catalog.array_agg(a.pid) FROM pg_catalog.pg_stat_activity a"
    " WHERE a.backend_type = 'autovacuum worker'"
    " AND a.datname = pg_catalog.current_database()) AS autovacuum_workers,"
    " pg_catalog.now() AS server_now"
)
# Autovacuum transactions a worker visit costs besides its tables: its start-up and its last one.
_AUTOVACUUM_VISIT_XACTS = 2


def _statement(body: sql.Composable, force_flush: bool) -> sql.Composed:
    """Mark a collector statement and, where available, make its stats publish at once."""
    parts: list[sql.Composable] = [_MARKER, body]
    if force_flush:
        parts.append(_FORCE_FLUSH)
    return sql.Composed(parts)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _standbys(rows: Any) -> tuple[StandbyState, ...]:
    """Parse the json_agg of pg_stat_replication rows (None when there are no standbys)."""
    if not rows:
        return ()
    return tuple(
        StandbyState(
            application_name=str(r.get("application_name") or ""),
            client_addr=r.get("client_addr"),
            state=r.get("state"),
            sync_state=r.get("sync_state"),
            write_lag_s=_opt_float(r.get("write_lag_s")),
            flush_lag_s=_opt_float(r.get("flush_lag_s")),
            replay_lag_s=_opt_float(r.get("replay_lag_s")),
            lag_bytes=_opt_int(r.get("lag_bytes")),
        )
        for r in rows
    )


@dataclass
class _Link:
    """Connection and compensation state of one instance."""

    target: Target
    conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
    poll_sql: sql.Composed | None = None
    # Collector transactions on this server since the counter baseline (see module docstring).
    own_xacts: int = 0
    last_raw_xacts: int | None = None
    last_epoch: str | None = None
    # Autovacuum's transactions in the polled database since the baseline, and what the last
    # poll saw of it (operations so far, its clock, the workers running then).
    background_xacts: int = 0
    autovacuum_ops: int | None = None
    server_now: Any = None
    autovacuum_workers: frozenset[int] = frozenset()
    charged_workers: frozenset[int] = frozenset()
    client_xacts: int | None = None  # the last client count handed out (never lowered)
    standbys: tuple[StandbyState, ...] = field(default_factory=tuple)
    sync_waiting: int = 0  # sessions stuck waiting for a synchronous standby at the last poll
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
            return f"polling PostgreSQL on {link.target.host} failed: {_first_line(exc)}"

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
                cur = await conn.execute(poll_sql, {"since": link.server_now})
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
                raise _PollError(f"lost the connection to PostgreSQL on {host}: {_first_line(exc)}") from exc
            link.own_xacts += 1  # it ran and rolled back: xact_rollback counts it
            raise _PollError(f"statistics query failed on {host}: {_first_line(exc)}", keep_connection=True) from exc
        link.own_xacts += 1
        t1 = time.monotonic()
        wall = time.time() - (t1 - t0) / 2
        if row is None:
            raise _PollError(f"statistics query on {host} returned no row")
        (raw_xacts, raw_client_xacts, all_calls, client_calls, lag_bytes, standbys, epoch, sync_waiting,
         autovacuum_ops, autovacuum_tables, autovacuum_workers, server_now) = row[:12]
        raw_xacts = int(raw_xacts)
        epoch = str(epoch)
        reset = link.last_raw_xacts is not None and (raw_xacts < link.last_raw_xacts or epoch != link.last_epoch)
        if reset:
            # Counters were reset or this is another server: our past statements are not in
            # them any more; the tracker re-baselines on the same signal.
            own_before = 0
            link.own_xacts = 1
            link.background_xacts, link.autovacuum_ops, link.client_xacts = 0, None, None
            link.autovacuum_workers = link.charged_workers = frozenset()
        link.last_raw_xacts, link.last_epoch = raw_xacts, epoch
        link.standbys = _standbys(standbys)
        link.sync_waiting = int(sync_waiting or 0)
        self._count_autovacuum(link, int(autovacuum_ops or 0), int(autovacuum_tables or 0),
                               frozenset(autovacuum_workers or ()))
        link.server_now = server_now
        client_xacts = int(raw_client_xacts or 0) - own_before - link.background_xacts
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
            calls=_opt_int(client_calls),
            replay_lag_bytes=_opt_int(lag_bytes),
            epoch=epoch,
            all_xacts=raw_xacts - own_before,
            all_calls=_opt_int(all_calls),
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
            raise _PollError(f"cannot connect to PostgreSQL on {host}: {_first_line(exc)}") from exc
        link.conn = conn
        link.own_xacts += _STARTUP_XACTS
        force_flush = conn.info.server_version >= _FORCE_FLUSH_VERSION
        try:
            async with asyncio.timeout(self.query_timeout_s):
                cur = await conn.execute(_statement(_CHECK, force_flush))
                row = await cur.fetchone()
        except TimeoutError as exc:
            raise _PollError(f"PostgreSQL on {host} did not answer within {self.query_timeout_s:g} s") from exc
        except psycopg.Error as exc:
            if not (conn.broken or conn.closed):
                link.own_xacts += 1
            raise _PollError(f"checking pg_stat_statements on {host} failed: {_first_line(exc)}") from exc
        link.own_xacts += 1
        schema = row[0] if row is not None and row[1] else None
        calls = (_CALLS.format(schema=sql.Identifier(schema), client_databases=_CLIENT_DATABASES)
                 if schema else _NO_CALLS)
        link.poll_sql = _statement(
            _POLL.format(calls=calls, client_databases=_CLIENT_DATABASES,
                         since=sql.SQL("{}::timestamptz").format(sql.Placeholder("since"))),
            force_flush)
