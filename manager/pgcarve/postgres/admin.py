"""Statements that tune a server or read facts about it over an admin session: settings changed
with ALTER SYSTEM, the server's version, files the server can read (its kernel's /proc).

Used by the benchmarks (bench/) to set up each case and record where it ran. Each function takes
an open autocommit session (postgres.session.connect) as pgcarve's superuser and raises psycopg
errors as they come.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from psycopg import sql

from pgcarve.postgres.session import Connection

# Contexts whose settings take effect only when the server restarts (or never change).
RESTART_CONTEXTS = ("postmaster", "internal")


@dataclass(frozen=True)
class SettingsChange:
    """What `alter_settings` did: settings applied (name -> value) and settings left alone (name -> why)."""

    applied: dict[str, str] = field(default_factory=dict)
    not_applied: dict[str, str] = field(default_factory=dict)


def alter_settings(conn: Connection, settings: Mapping[str, str], settle_s: float = 0.3) -> SettingsChange:
    """ALTER SYSTEM every setting that takes effect on a reload, then reload and give the server
    `settle_s` to apply it; settings that are unknown or need a restart are reported, not set."""
    applied: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, value in settings.items():
        row = conn.execute("select context from pg_settings where name = %s", (name,)).fetchone()
        if row is None:
            skipped[name] = "unknown setting"
        elif row[0] in RESTART_CONTEXTS:
            skipped[name] = f"needs a restart ({row[0]}); not applied"
        else:
            conn.execute(sql.SQL("alter system set {} = {}").format(sql.Identifier(name), sql.Literal(value)))
            applied[name] = value
    conn.execute("select pg_reload_conf()")
    time.sleep(settle_s)  # pg_reload_conf only signals the postmaster
    return SettingsChange(applied=applied, not_applied=skipped)


def effective_settings(conn: Connection, names: Iterable[str]) -> dict[str, str]:
    """The value in effect of each known setting among `names`, with its unit ("16384 x 8kB")."""
    rows = conn.execute("select name, setting, unit from pg_settings where name = any(%s)",
                        (list(names),)).fetchall()
    return {str(r[0]): f"{r[1]}{'' if r[2] is None else ' x ' + str(r[2])}" for r in rows}


def server_version(conn: Connection) -> str:
    """`select version()`: the server's version and how it was built."""
    row = conn.execute("select version()").fetchone()
    return str(row[0]) if row else ""


def read_server_file(conn: Connection, path: str, max_bytes: int = 1 << 20) -> str:
    """The first `max_bytes` of a file on the server's machine (pg_read_file, superuser only),
    e.g. /proc/version or /proc/stat of a guest's kernel."""
    row = conn.execute("select pg_read_file(%s, 0, %s)", (path, max_bytes)).fetchone()
    return str(row[0]) if row else ""
