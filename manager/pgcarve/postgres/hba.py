"""Who may replicate from a guest: the replication rules of its pg_hba.conf, rewritten at run time.

A guest's pg_hba.conf is composed at every boot by the image's setup script (pgcarve-guest-setup)
from its seed, plus one replication rule per address listed in STANDBYS_FILE_NAME beside
pg_hba.conf. Standby addresses come from DHCP, so they are known only once a standby has booted
(it retries its first clone until it is let in): the manager then writes that file and the
matching rules into pg_hba.conf with server-side COPY, as superuser, and reloads. PostgreSQL 15's
pg_hba.conf has no include directive, so the rules go into the file itself; they are the exact
lines the setup script writes, so a restart composes the same file.

`allow_standbys(conn, addresses)` is the one entry point: call it on a primary (and on the
standbys that may be promoted) whenever the set of its standbys' addresses changes.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Iterable

from psycopg import sql

from pgcarve.addresses import check_address
from pgcarve.errors import ConfigError
from pgcarve.postgres.session import REPLICATION_USER, Connection

STANDBYS_FILE_NAME = "pgcarve-standbys"
# A replication-role rule as pgcarve writes it (and as the setup script does at boot).
_REPLICATION_RULE = re.compile(rf"^\s*hostssl\s+(replication|postgres)\s+{REPLICATION_USER}\s+\S+\s+scram-sha-256\s*$")
# COPY's text format would escape these, changing the line it writes.
_UNCOPYABLE = re.compile(r"[\t\\\r\n]")


def normalized_addresses(addresses: Iterable[str]) -> list[str]:
    """Plain IP addresses, validated, without duplicates, sorted (ConfigError otherwise)."""
    unique = {ipaddress.ip_address(check_address(a)) for a in addresses}
    return [str(a) for a in sorted(unique, key=lambda a: (a.version, int(a)))]


def replication_rules(address: str) -> list[str]:
    """The pg_hba.conf lines that let the replication role in from one address, over TLS only:
    streaming, and a session to database postgres, which pg_rewind reads the new primary's files
    through when a former primary rejoins its instance."""
    ip = ipaddress.ip_address(check_address(address))
    net = f"{ip}/{32 if ip.version == 4 else 128}"
    return [f"hostssl replication {REPLICATION_USER} {net} scram-sha-256",
            f"hostssl postgres {REPLICATION_USER} {net} scram-sha-256"]


def with_standbys(hba_text: str, addresses: Iterable[str]) -> list[str]:
    """The lines of `hba_text` with its replication rules replaced by one rule per address, at
    the end: every other line stays as it is."""
    kept = [line for line in hba_text.splitlines() if not _REPLICATION_RULE.match(line)]
    while kept and not kept[-1].strip():
        kept.pop()
    return kept + [rule for a in normalized_addresses(addresses) for rule in replication_rules(a)]


def _lines_literal(lines: list[str]) -> sql.Composable:
    return sql.SQL("array[{}]::text[]").format(sql.SQL(", ").join(sql.Literal(line) for line in lines))


def _write_lines(conn: Connection, path: str, lines: list[str]) -> None:
    """Write `lines` to `path` on the server's machine (COPY ... TO, as superuser)."""
    conn.execute(sql.SQL("copy (select line from unnest({}) with ordinality as t(line, n) order by n) to {}")
                 .format(_lines_literal(lines), sql.Literal(path)))


def allow_standbys(conn: Connection, addresses: Iterable[str]) -> list[str]:
    """Let the replication role in to this server from exactly `addresses` (and from nowhere
    else), now and after a restart; returns the addresses, normalized.

    Rewrites pg_hba.conf's replication rules and the setup script's list beside it, checks the
    new file with pg_hba_file_rules (restoring the old one if PostgreSQL finds an error), then
    reloads. Works on a hot standby too, so a standby is ready for its siblings before a promotion.
    """
    allowed = normalized_addresses(addresses)
    row = conn.execute("select current_setting('hba_file'), pg_read_file(current_setting('hba_file'))").fetchone()
    if row is None:
        raise ConfigError("the server did not report its hba_file")
    hba_file, current = str(row[0]), str(row[1])
    lines = with_standbys(current, allowed)
    bad = [line for line in lines if _UNCOPYABLE.search(line)]
    if bad:
        raise ConfigError(f"{hba_file} has a line pgcarve cannot rewrite (tab or backslash): {bad[0]!r}; "
                          "replace tabs by spaces in that file")
    _write_lines(conn, posixpath.join(posixpath.dirname(hba_file), STANDBYS_FILE_NAME), allowed)
    _write_lines(conn, hba_file, lines)
    errors = conn.execute("select line_number, error from pg_hba_file_rules where error is not null").fetchall()
    if errors:
        _write_lines(conn, hba_file, current.splitlines())
        raise ConfigError(f"the new {hba_file} was refused by PostgreSQL (line {errors[0][0]}: {errors[0][1]}); "
                          "the previous file was put back")
    conn.execute("select pg_reload_conf()")
    return allowed


def replication_addresses(conn: Connection) -> list[str]:
    """The addresses this server's pg_hba.conf (as on disk) lets the replication role in from."""
    rows = conn.execute(
        "select address, netmask from pg_hba_file_rules "
        "where 'replication' = any(database) and %s = any(user_name) and address is not null",
        (REPLICATION_USER,),
    ).fetchall()
    return [str(r[0]) for r in rows]
