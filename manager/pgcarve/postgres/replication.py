"""Every statement pgcarve sends to run replication: readiness, slots, synchronous standby names,
promotion, pointing a standby at a new primary, fencing writes before a removal.

Each function takes an open autocommit session (postgres.session.connect) and raises
psycopg errors as they come; callers translate them where they know what was being done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from psycopg import sql

from pgcarve.errors import ConfigError
from pgcarve.naming import application_name
from pgcarve.postgres.conninfo import standby_conninfo
from pgcarve.postgres.session import Connection

SyncMode = Literal["FIRST", "ANY"]


def lsn_value(lsn: str | None) -> int:
    """'16/B374D848' -> a comparable integer (None -> -1)."""
    if not lsn:
        return -1
    high, low = lsn.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def synchronous_standby_names(mode: SyncMode, count: int, standbys: Sequence[str]) -> str:
    """E.g. FIRST 1 (pgc_01_s1, pgc_01_s2): the experiment's one sync + one potential standby."""
    if not standbys:
        return ""
    if not 1 <= count <= len(standbys):
        raise ConfigError(f"sync standby count {count} must be between 1 and {len(standbys)} (standbys)")
    names = ", ".join(application_name(s) for s in standbys)
    return f"{mode} {count} ({names})"


def in_recovery(conn: Connection) -> bool:
    """True on a standby (PostgreSQL is replaying WAL), False on a primary."""
    row = conn.execute("select pg_is_in_recovery()").fetchone()
    return bool(row and row[0])


def wal_position(conn: Connection) -> tuple[bool, int]:
    """(in recovery, the furthest WAL position this server has received or replayed)."""
    row = conn.execute(
        "select pg_is_in_recovery(), greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::text"
    ).fetchone()
    if row is None:
        return False, -1
    return bool(row[0]), lsn_value(row[1])


def create_slot(conn: Connection, slot: str) -> None:
    """A physical replication slot (reserving WAL now) unless it exists already."""
    conn.execute(
        "select pg_create_physical_replication_slot(%s, true) "
        "where not exists (select 1 from pg_replication_slots where slot_name = %s)",
        (slot, slot),
    )


def streaming_standbys(conn: Connection) -> set[str]:
    """application_name of every standby streaming from this server now."""
    rows = conn.execute("select application_name from pg_stat_replication where state = 'streaming'").fetchall()
    return {str(r[0]) for r in rows}


def streaming_synchronous_standbys(conn: Connection) -> list[str]:
    """application_name of every standby streaming now as synchronous (sync, or quorum for ANY)."""
    rows = conn.execute("select application_name from pg_stat_replication "
                        "where state = 'streaming' and sync_state in ('sync', 'quorum')").fetchall()
    return [str(r[0]) for r in rows]


def set_synchronous_standby_names(conn: Connection, value: str) -> None:
    """ALTER SYSTEM + reload (works on a hot standby too, before it is promoted)."""
    conn.execute(sql.SQL("alter system set synchronous_standby_names = {}").format(sql.Literal(value)))
    conn.execute("select pg_reload_conf()")


def promote(conn: Connection, wait_s: int = 300) -> bool:
    """pg_promote, waiting up to ``wait_s``; True once the server accepts writes."""
    row = conn.execute("select pg_promote(true, %s)", (wait_s,)).fetchone()
    return bool(row and row[0])


def follow(conn: Connection, primary_address: str, standby_guest: str, slot: str, replication_password: str) -> None:
    """Point a running standby at another primary (PostgreSQL 13+ applies this on reload)."""
    conninfo = standby_conninfo(primary_address, standby_guest, replication_password)
    conn.execute(sql.SQL("alter system set primary_conninfo = {}").format(sql.Literal(conninfo)))
    conn.execute(sql.SQL("alter system set primary_slot_name = {}").format(sql.Literal(slot)))
    conn.execute("select pg_reload_conf()")


def refuse_writes(conn: Connection, reason: str) -> str:
    """Make the primary read-only for new transactions and end every client session; returns the
    WAL position after which nothing more can be written. `reason` is kept beside the setting
    (pgcarve.write_fence), so the fence can be reported, and lifted if its operation died."""
    conn.execute("alter system set default_transaction_read_only = on")
    _declare_fence_setting(conn)
    conn.execute(sql.SQL("alter system set pgcarve.write_fence = {}").format(sql.Literal(reason)))
    conn.execute("select pg_reload_conf()")
    # Each ended session is waited for (up to 5 s): a transaction already under way when the
    # default changed could still write its commit after the position read below.
    conn.execute("select pg_terminate_backend(pid, 5000) from pg_stat_activity "
                 "where backend_type = 'client backend' and pid <> pg_backend_pid()")
    row = conn.execute("select pg_current_wal_lsn()::text").fetchone()
    return str(row[0]) if row else "0/0"


def synchronous_standbys_at(conn: Connection, standby_guests: Sequence[str], lsn: str) -> list[str]:
    """Which of these standbys are synchronous and have replayed up to ``lsn``."""
    rows = conn.execute(
        "select application_name from pg_stat_replication "
        "where application_name = any(%s) and replay_lsn >= %s::pg_lsn and sync_state in ('sync', 'quorum')",
        ([application_name(s) for s in standby_guests], lsn),
    ).fetchall()
    return [str(r[0]) for r in rows]


def synchronous_standby(conn: Connection) -> list[str]:
    """application_name of the standbys PostgreSQL reports as synchronous now."""
    rows = conn.execute("select application_name from pg_stat_replication where sync_state = 'sync'").fetchall()
    return [str(r[0]) for r in rows]


def current_wal_lsn(conn: Connection) -> int:
    """The primary's current WAL write position."""
    row = conn.execute("select pg_current_wal_lsn()::text").fetchone()
    return lsn_value(row[0] if row else None)


def show_synchronous_standby_names(conn: Connection) -> str:
    row = conn.execute("select current_setting('synchronous_standby_names')").fetchone()
    return str(row[0]) if row else ""


def replica_rows(conn: Connection) -> list[tuple[str, str, str, int]]:
    """(application_name, state, sync_state, write position) of every standby connected now."""
    rows = conn.execute(
        "select application_name, state, sync_state, coalesce(write_lsn, '0/0')::text from pg_stat_replication"
    ).fetchall()
    return [(str(r[0]), str(r[1] or ""), str(r[2] or ""), lsn_value(r[3])) for r in rows]


def receiving(conn: Connection) -> bool:
    """Does this standby's WAL receiver stream from a primary now?"""
    row = conn.execute("select count(*) from pg_stat_wal_receiver where status = 'streaming'").fetchone()
    return bool(row and row[0])


def detach(conn: Connection) -> None:
    """Stop a standby from streaming from anyone (its WAL receiver ends on reload); it stays a
    standby, replaying nothing new, until pointed at a primary again."""
    conn.execute("alter system set primary_conninfo = ''")
    conn.execute("select pg_reload_conf()")


MANAGER_LEASE = "/var/lib/postgresql/pgcarve-manager-lease"


def renew_manager_lease(conn: Connection) -> None:
    """Word from the manager to the guest's watchdog (pgcarve-watchdog): a file the watchdog reads
    the age of. A server-side file write: no WAL, so it never waits for a synchronous standby."""
    conn.execute(sql.SQL("copy (select pg_catalog.now()) to {}").format(sql.Literal(MANAGER_LEASE)))


def settle_new_primary(conn: Connection) -> None:
    """After a promotion: a checkpoint, so the new timeline is in its control file (pg_rewind reads
    it there), and the settings that belonged to its time as a standby, or to a fence, gone."""
    conn.execute("checkpoint")
    conn.execute("alter system reset primary_conninfo")
    conn.execute("alter system reset primary_slot_name")
    conn.execute("alter system reset default_transaction_read_only")
    _declare_fence_setting(conn)
    conn.execute("alter system reset pgcarve.write_fence")
    conn.execute("select pg_reload_conf()")


def allow_writes(conn: Connection) -> None:
    """Undo refuse_writes: new transactions may write again."""
    conn.execute("alter system reset default_transaction_read_only")
    _declare_fence_setting(conn)
    conn.execute("alter system reset pgcarve.write_fence")
    conn.execute("select pg_reload_conf()")


def _declare_fence_setting(conn: Connection) -> None:
    """PostgreSQL before 17 lets ALTER SYSTEM touch a custom setting only once the session knows
    it: a session-level SET declares it (and changes nothing for anyone else)."""
    conn.execute("select set_config('pgcarve.write_fence', coalesce(current_setting('pgcarve.write_fence', true), "
                 "''), false)")


def write_fence(conn: Connection) -> str | None:
    """The reason refuse_writes recorded, if its fence holds on this server now."""
    row = conn.execute("select current_setting('default_transaction_read_only')::bool, "
                       "nullif(current_setting('pgcarve.write_fence', true), '')").fetchone()
    return str(row[1]) if row and row[0] and row[1] else None
