"""Insert load with pgbench, the experiment's way.

The experiment (shared/seeds) ran one table `test(id serial primary key, info text, crt_time
timestamp)` and the script `insert into test(info) values (null);` as
`pgbench -M prepared -n -r -P 1 -f test3.sql -c 64 -j 64 -T 120`. Every transaction is one
commit that waits for the synchronous standby, which is what carving is about.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from psycopg import sql

from pgcarve.errors import ConfigError, PgcarveError
from pgcarve.postgres import session

INSERT_SCRIPT = "insert into test(info) values (null);\n"
CREATE_TABLE = "create table if not exists test(id serial primary key, info text, crt_time timestamp)"
_TABLE_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
TPS_RE = re.compile(r"^tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)",
                    re.M)
LATENCY_RE = re.compile(r"^latency average = ([0-9.]+) ms", re.M)
TXNS_RE = re.compile(r"^number of transactions actually processed: (\d+)", re.M)
FAILED_RE = re.compile(r"^number of failed transactions: (\d+)", re.M)


def _table(name: str) -> str:
    if not _TABLE_RE.fullmatch(name):
        raise ConfigError(f"table name {name!r} is invalid (lower-case letters, digits, '_')")
    return name


def insert_script(table: str = "test") -> str:
    """The experiment's one-statement script, inserting into `table` (INSERT_SCRIPT for `test`)."""
    return f"insert into {_table(table)}(info) values (null);\n"  # noqa: S608  (a checked identifier)


def create_test_table(conn: session.Connection, table: str = "test") -> None:
    """The experiment's table (CREATE_TABLE for `test`) under another name, unless it exists."""
    conn.execute(sql.SQL("create table if not exists {}(id serial primary key, info text, crt_time timestamp)")
                 .format(sql.Identifier(_table(table))))


def insert_row(conn: session.Connection, info: str, table: str = "test") -> None:
    """One committed row (autocommit), e.g. a probe that a primary takes writes."""
    conn.execute(sql.SQL("insert into {}(info) values (%s)").format(sql.Identifier(_table(table))), (info,))


@dataclass(frozen=True)
class PgbenchResult:
    instance: str
    tps: float
    latency_avg_ms: float | None
    transactions: int
    failed: int
    started_at: float  # wall clock, when pgbench was started
    finished_at: float
    output: str


def setup_transactions(clients: int) -> int:
    """Transactions one `run_pgbench` adds beyond those pgbench reports, all made by clients:
    the CREATE TABLE session (its start-up and the statement), pgbench's main session, and per
    client its start-up and its PREPARE (-M prepared). Measured on PostgreSQL 15: pgbench
    -M prepared -n -c C adds exactly 2C + 1 to xact_commit beyond its transactions."""
    return 2 + 1 + 2 * clients


def pgbench_path() -> str:
    path = shutil.which("pgbench")
    if path is None:
        raise ConfigError("pgbench is not installed: run `make deps` (Debian package postgresql-client)")
    return path


def parse_pgbench(instance: str, output: str, started_at: float, finished_at: float) -> PgbenchResult:
    tps = TPS_RE.search(output)
    if tps is None:
        raise PgcarveError(f"pgbench on {instance} printed no TPS line:\n{output[-600:]}")
    latency = LATENCY_RE.search(output)
    txns = TXNS_RE.search(output)
    failed = FAILED_RE.search(output)
    return PgbenchResult(
        instance=instance,
        tps=float(tps.group(1)),
        latency_avg_ms=float(latency.group(1)) if latency else None,
        transactions=int(txns.group(1)) if txns else 0,
        failed=int(failed.group(1)) if failed else 0,
        started_at=started_at,
        finished_at=finished_at,
        output=output,
    )


def run_pgbench(name: str, endpoint: tuple[str, int] | None, password: str, clients: int, jobs: int,
                seconds: int, script: str = INSERT_SCRIPT, extra_args: tuple[str, ...] = (), *,
                tls: session.ClientTls) -> PgbenchResult:
    """Run pgbench as pgcarve's admin against one instance's PostgreSQL at `endpoint`, in the
    clients' database, after creating the experiment's table there; bounded by -T seconds.
    Every session verifies the server's certificate (`tls`)."""
    if not (1 <= clients <= 1000 and 1 <= jobs <= clients and 1 <= seconds <= 3600):
        raise ConfigError("pgbench: need 1 <= jobs <= clients <= 1000 and 1 <= seconds <= 3600")
    if endpoint is None:
        raise PgcarveError(f"{name} has no reachable endpoint")
    host, port = endpoint
    with session.connect(host, port, password, database=session.CLIENT_DATABASE, tls=tls) as conn:
        conn.execute(CREATE_TABLE)
    with tempfile.TemporaryDirectory(prefix="pgcarve-pgbench-") as tmp:
        script_file = Path(tmp) / "insert.sql"
        script_file.write_text(script)
        env = dict(os.environ, PGPASSWORD=password, PGCONNECT_TIMEOUT="10", **tls.environment())
        started = time.time()
        proc = subprocess.run(
            [pgbench_path(), "-h", host, "-p", str(port), "-U", session.ADMIN_USER, "-M", "prepared", "-n", "-r",
             "-f", str(script_file), "-c", str(clients), "-j", str(jobs), "-T", str(seconds), *extra_args,
             session.CLIENT_DATABASE],
            capture_output=True, text=True, env=env, timeout=seconds + 120, check=False,
        )
        finished = time.time()
    if proc.returncode != 0:
        raise PgcarveError(f"pgbench on {name} failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    return parse_pgbench(name, proc.stdout + proc.stderr, started, finished)


def run_concurrently(targets: Sequence[tuple[str, tuple[str, int] | None]], password: str, clients: int, jobs: int,
                     seconds: int, *, tls: session.ClientTls) -> list[PgbenchResult]:
    """pgbench on every (name, endpoint) at the same time."""
    if not targets:
        raise PgcarveError("no running primary to load: create instances first (`pgcarve up --instances N`)")
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        futures = [pool.submit(run_pgbench, name, endpoint, password, clients, jobs, seconds, tls=tls)
                   for name, endpoint in targets]
        return [f.result() for f in futures]
