"""Throwaway PostgreSQL 15 servers on 127.0.0.1, for the tests against local servers
(tests/integration/test_collector_local.py, test_postgres_local.py) and the collector's benchmark
(bench/collector_bench.py).

Durability off and trust auth on loopback only; initdb and postgres run as the `postgres` user
when we are root (they refuse root). Every server is stopped by its postmaster PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

PG_BIN = Path("/usr/lib/postgresql/15/bin")
# Every server: loopback only, no unix socket, pg_stat_statements loadable, and durability and
# autovacuum off so runs differ only by what a test or benchmark does (later -c settings win).
BASE_SETTINGS = (
    "listen_addresses=127.0.0.1",
    "unix_socket_directories=",
    "shared_preload_libraries=pg_stat_statements",
    "fsync=off",
    "synchronous_commit=off",
    "full_page_writes=off",
    "autovacuum=off",
    "shared_buffers=16MB",
)
EXPERIMENT_TABLE = "create table test(id serial primary key, info text, crt_time timestamp)"


def available() -> bool:
    """Are Debian's PostgreSQL 15 server binaries installed (`make apt` installs them)?"""
    return (PG_BIN / "postgres").exists()


def as_postgres() -> dict[str, Any]:
    """subprocess arguments that drop to the postgres user when we are root."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def run_pg(*args: str) -> None:
    """Run a PostgreSQL tool (initdb, pg_basebackup, cp of a data directory) as as_postgres()."""
    subprocess.run(args, check=True, capture_output=True, **as_postgres())


def free_ports(count: int) -> list[int]:
    """Ports free right now on 127.0.0.1 (all held open together so they are distinct)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def prepare_base(base: Path) -> Path:
    """A directory for data directories and logs that the postgres user may write."""
    base.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    return base


def initdb(datadir: Path) -> None:
    """A new cluster, superuser `postgres`, trust auth (the servers listen on loopback only)."""
    run_pg(str(PG_BIN / "initdb"), "-D", str(datadir), "-A", "trust", "-U", "postgres", "-N", "-E", "UTF8",
           "--locale=C.UTF-8")


def clone(template: Path, datadir: Path) -> None:
    """A copy of a cleanly stopped cluster is a new cluster: much cheaper than initdb."""
    run_pg("cp", "-a", str(template), str(datadir))


@dataclass
class LocalServer:
    """One postmaster on 127.0.0.1:`port`, data in `datadir`, log beside it."""

    name: str
    datadir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    client_params: dict[str, str] = field(default_factory=dict)  # e.g. sslmode, sslrootcert
    host: str = "127.0.0.1"  # or a unix socket directory (a server in another network namespace)
    netns: str | None = None  # run the postmaster in this network namespace (root only)

    @property
    def dsn(self) -> str:
        extra = "".join(f" {key}={value}" for key, value in self.client_params.items())
        return f"host={self.host} port={self.port} user=postgres dbname=postgres connect_timeout=5{extra}"

    @property
    def log_file(self) -> Path:
        return self.datadir.parent / f"{self.name}.log"

    def start(self, *settings: str, env: dict[str, str] | None = None) -> None:
        """Start with BASE_SETTINGS, then `settings` (NAME=VALUE) on top (in environment `env`,
        e.g. a HOME the postgres user can read, where a standby's libpq looks for client certificates)."""
        args = [str(PG_BIN / "postgres"), "-D", str(self.datadir), "-p", str(self.port)]
        for setting in (*BASE_SETTINGS, *settings):
            args += ["-c", setting]
        user = as_postgres()
        if self.netns is not None:
            # Each of these execs the next: the PID is still the postmaster's.
            args = ["ip", "netns", "exec", self.netns, "setpriv", "--reuid=postgres", "--regid=postgres",
                    "--clear-groups", "--", *args]
            user = {}
        with self.log_file.open("ab") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, **user)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until a session can run a query; RuntimeError with the log's tail if the server exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                tail = self.log_file.read_text(errors="replace")[-2000:] if self.log_file.exists() else ""
                raise RuntimeError(f"postgres {self.name} is not running: {tail}")
            try:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    conn.execute("select 1")
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def signal_stop(self) -> None:
        """Ask for a fast shutdown by postmaster PID (SIGINT), without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def wait_stopped(self, wait_s: float = 30.0) -> None:
        """Until the postmaster exited; immediate shutdown (SIGQUIT), then SIGKILL, if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((None, wait_s), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            if sig is not None and proc.poll() is None:
                os.kill(proc.pid, sig)
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        self.signal_stop()
        self.wait_stopped()

    def _children(self) -> list[int]:
        if self.proc is None:
            return []
        return [int(p) for p in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()]

    def process_pids(self) -> list[int]:
        """The postmaster and all its children."""
        return [self.proc.pid, *self._children()] if self.proc is not None else []

    def backend_pids(self) -> list[int]:
        """Client backends of this postmaster (its children titled with a 127.0.0.1 peer)."""
        pids = []
        for pid in self._children():
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"127.0.0.1(" in title:
                pids.append(pid)
        return pids
