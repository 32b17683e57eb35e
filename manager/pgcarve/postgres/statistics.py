"""The statements the collector sends to each primary, and what their rows mean.

One poll statement per round reads everything the collector needs in a single round trip:
transaction counters (all databases, and the clients' databases only), pg_stat_statements calls
(when the extension is loaded), replication rows, sessions waiting on a synchronous standby, and
what autovacuum did in the polled database. Every statement is marked (/* pgcarve-collector */)
and, on PostgreSQL 15+, forces its own statistics out when it ends (see control/collector.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import sql

from pgcarve.postgres.session import MANAGER_DATABASE

# First PostgreSQL release with pg_stat_force_next_flush() (and shared-memory statistics).
FORCE_FLUSH_VERSION = 150000


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
    # visited since the previous poll, the workers in here now, and the newest autovacuum time
    # this poll saw. That mark, not the clock, is the next poll's ``since``: an operation that
    # ends between now() and the statistics read is in this poll's operations, so its table
    # must not count again next time. A table whose vacuum came before ``since`` (after
    # ``before``) and its analyze after was one visit split by a poll: counted once.
    " (SELECT pg_catalog.sum(t.autovacuum_count + t.autoanalyze_count)"
    " FROM pg_catalog.pg_stat_all_tables t)::bigint AS autovacuum_ops,"
    " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_all_tables t"
    " WHERE t.last_autovacuum > {since}"
    " OR (t.last_autoanalyze > {since} AND NOT COALESCE(t.last_autovacuum > {before}, false)))::int"
    " AS autovacuum_tables,"
    " (SELECT pg_catalog.array_agg(a.pid) FROM pg_catalog.pg_stat_activity a"
    " WHERE a.backend_type = 'autovacuum worker'"
    " AND a.datname = pg_catalog.current_database()) AS autovacuum_workers,"
    " (SELECT pg_catalog.max(GREATEST(t.last_autovacuum, t.last_autoanalyze))"
    " FROM pg_catalog.pg_stat_all_tables t) AS autovacuum_mark,"
    # A write fence (replication.refuse_writes): read-only for new transactions, and why.
    " CASE WHEN pg_catalog.current_setting('default_transaction_read_only')::bool"
    " AND NOT pg_catalog.pg_is_in_recovery() THEN COALESCE(NULLIF("
    "pg_catalog.current_setting('pgcarve.write_fence', true), ''), 'read-only by configuration') END"
    " AS write_fence"
)


def _statement(body: sql.Composable, force_flush: bool) -> sql.Composed:
    """Mark a collector statement and, where available, make its stats publish at once."""
    parts: list[sql.Composable] = [_MARKER, body]
    if force_flush:
        parts.append(_FORCE_FLUSH)
    return sql.Composed(parts)


def check_statement(force_flush: bool) -> sql.Composed:
    """Is pg_stat_statements installed (its schema) and loaded? One row: (schema, loaded)."""
    return _statement(_CHECK, force_flush)


def poll_statement(pgss_schema: str | None, force_flush: bool) -> sql.Composed:
    """The poll; parameters ``since`` and ``before``: the autovacuum marks of the previous two
    polls (None when there was none, or autovacuum has never run)."""
    calls = (_CALLS.format(schema=sql.Identifier(pgss_schema), client_databases=_CLIENT_DATABASES)
             if pgss_schema else _NO_CALLS)

    def mark(name: str) -> sql.Composable:
        return sql.SQL("COALESCE({}::timestamptz, '-infinity')").format(sql.Placeholder(name))

    return _statement(
        _POLL.format(calls=calls, client_databases=_CLIENT_DATABASES, since=mark("since"), before=mark("before")),
        force_flush)


@dataclass(frozen=True)
class PollRow:
    """One poll's answer. Counters are PostgreSQL's own, the collector's statements included."""

    all_xacts: int  # xact_commit + xact_rollback, every database
    client_xacts: int  # the same in the clients' databases (not templates, not pgcarve's own)
    all_calls: int | None  # pg_stat_statements calls (None without the extension)
    client_calls: int | None
    replay_lag_bytes: int | None
    standbys: tuple[StandbyState, ...]
    epoch: str  # the postmaster's start time: another value means other counters
    sync_waiting: int
    autovacuum_ops: int  # autovacuum + autoanalyze counts of the polled database's tables
    autovacuum_tables: int  # table visits autovacuum finished since ``since``
    autovacuum_workers: frozenset[int]  # autovacuum workers in the polled database now
    autovacuum_mark: Any  # the newest autovacuum/autoanalyze time seen, passed back as ``since``
    write_fence: str | None = None  # why new writes are refused on this primary (None: they are not)

    @classmethod
    def parse(cls, row: tuple[Any, ...]) -> PollRow:
        (all_xacts, client_xacts, all_calls, client_calls, lag_bytes, standbys, epoch, sync_waiting,
         autovacuum_ops, autovacuum_tables, autovacuum_workers, autovacuum_mark, write_fence) = row[:13]
        return cls(
            all_xacts=int(all_xacts),
            client_xacts=int(client_xacts or 0),
            all_calls=_opt_int(all_calls),
            client_calls=_opt_int(client_calls),
            replay_lag_bytes=_opt_int(lag_bytes),
            standbys=_standbys(standbys),
            epoch=str(epoch),
            sync_waiting=int(sync_waiting or 0),
            autovacuum_ops=int(autovacuum_ops or 0),
            autovacuum_tables=int(autovacuum_tables or 0),
            autovacuum_workers=frozenset(autovacuum_workers or ()),
            autovacuum_mark=autovacuum_mark,
            write_fence=None if write_fence is None else str(write_fence),
        )


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


# -- what client sessions wait on ---------------------------------------------------------------

# The categories a sampled client session falls in, in the order reports list them. The experiment's
# symptom was commits waiting for the synchronous standby (SyncRep) while CPUs sat idle.
WAIT_CATEGORIES = ("SyncRep", "WAL write", "WAL insert", "other LWLocks", "IPC", "lock", "IO", "client", "CPU",
                   "other")
WAIT_MEANING = {
    "SyncRep": "a commit waits for its synchronous standby (IPC SyncRep)",
    "WAL write": "writing or flushing WAL (LWLock WALWrite, IO WAL*)",
    "WAL insert": "inserting into the WAL buffers (LWLock WALInsert, WALBufMapping)",
    "other LWLocks": "any other lightweight lock (ProcArray, XactSLRU, buffer mapping, ...)",
    "IPC": "waiting on another process, other than for the standby",
    "lock": "a heavyweight lock (row, relation, transaction id)",
    "IO": "data file reads and writes",
    "client": "waiting for the client: for its next statement, idle between transactions included, "
              "or to send it results (Client*)",
    "CPU": "running, no wait event",
    "other": "timeouts, buffer pins, extensions",
}
_WAL_INSERT_LOCKS = frozenset({"WALInsert", "WALBufMapping"})

# Client sessions only: not pgcarve's own (its database, or the sessions named in `exclude`), not
# the statement's own backend. pg_stat_activity is one snapshot per transaction: one statement,
# one sample.
_WAITS = sql.SQL(
    "SELECT a.state, a.wait_event_type, a.wait_event, pg_catalog.count(*)::int AS sessions"
    " FROM pg_catalog.pg_stat_activity a"
    " WHERE a.backend_type = 'client backend' AND a.pid <> pg_catalog.pg_backend_pid()"
    " AND a.datname IS DISTINCT FROM {manager}"
    " AND NOT (a.application_name = ANY ({exclude}))"
    " GROUP BY 1, 2, 3"
)


def waits_statement() -> sql.Composed:
    """One sample of what client sessions wait on; takes one parameter, ``exclude``: the
    application names of sessions to leave out (pgcarve's samplers and collector). Rows:
    (state, wait_event_type, wait_event, sessions)."""
    return sql.Composed([sql.SQL("/* pgcarve-waits */ "), _WAITS.format(manager=sql.Literal(MANAGER_DATABASE),
                                                exclude=sql.SQL("{}::text[]").format(sql.Placeholder("exclude")))])


def wait_category(state: str | None, wait_type: str | None, wait_event: str | None) -> str:
    """The WAIT_CATEGORIES entry of one pg_stat_activity row."""
    if wait_type is None:
        return "CPU" if state == "active" else "client"
    if wait_type == "IPC":
        return "SyncRep" if wait_event == "SyncRep" else "IPC"
    if wait_type == "LWLock":
        if wait_event == "WALWrite":
            return "WAL write"
        return "WAL insert" if wait_event in _WAL_INSERT_LOCKS else "other LWLocks"
    if wait_type == "IO":
        return "WAL write" if (wait_event or "").startswith("WAL") else "IO"
    if wait_type == "Client":
        return "client"
    if wait_type == "Lock":
        return "lock"
    return "other"


def wait_counts(rows: Any) -> dict[str, int]:
    """Sessions per category in one sample's rows (waits_statement)."""
    counts: dict[str, int] = {}
    for state, wait_type, wait_event, sessions in rows:
        category = wait_category(state, wait_type, wait_event)
        counts[category] = counts.get(category, 0) + int(sessions)
    return counts
