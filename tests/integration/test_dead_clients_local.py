"""A client whose host vanishes (no FIN, no RST) loses its backend, and the locks it held, within
about half a minute on a server with the guest image's settings (conf.d/50-pgcarve.conf:
tcp_keepalives_*, tcp_user_timeout, client_connection_check_interval), instead of the kernel's
two hours.

A local PostgreSQL 15 runs in a network namespace of its own with the image's settings file
included as shipped; two clients in a second namespace, joined by a veth pair, each hold a lock:
one idle in its transaction, one in a long query. The clients' link then goes down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.integration.conftest import wait_for
from tests.support import localpg
from tests.support.localpg import LocalServer

pytestmark = pytest.mark.localpg

REPO = Path(__file__).resolve().parents[2]
GUEST_SETTINGS = REPO / "images/rootfs/usr/share/pgcarve/postgresql.conf.d/50-pgcarve.conf"
SERVER_ADDRESS, CLIENT_ADDRESS = "10.78.255.1", "10.78.255.2"  # inside the two namespaces only
CLIENT_LIFETIME_S = 300  # a client process ends by itself after this, whatever happens

if not localpg.available():  # pragma: no cover - depends on the machine
    pytest.skip("PostgreSQL 15 server binaries are not installed (make apt installs them)", allow_module_level=True)
if os.geteuid() != 0:  # pragma: no cover - depends on the machine
    pytest.skip("needs root (network namespaces)", allow_module_level=True)

# One client: connect, take a lock, say so, then hold it (idle in the transaction, or in a query).
CLIENT = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1])
conn.execute("lock table {table} in access exclusive mode")
print(conn.info.backend_pid, flush=True)
if sys.argv[2] == "query":
    conn.execute("select pg_sleep(%s)", ({lifetime},))
else:
    time.sleep({lifetime})
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    """A server namespace and a client namespace joined by a veth pair; removed afterwards."""
    server_ns, client_ns = f"pgc-dc-srv-{os.getpid()}", f"pgc-dc-cli-{os.getpid()}"
    made: list[str] = []
    try:
        for ns in (server_ns, client_ns):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", server_ns, "link", "add", "dc-srv", "type", "veth", "peer", "name", "dc-cli", "netns", client_ns)
        for ns, dev, address in ((server_ns, "dc-srv", SERVER_ADDRESS), (client_ns, "dc-cli", CLIENT_ADDRESS)):
            ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
        yield server_ns, client_ns
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


@pytest.fixture
def server(namespaces: tuple[str, str]) -> Iterator[LocalServer]:
    """PostgreSQL in the server namespace: the image's settings file, a unix socket for the test
    (unix sockets are not bound to a network namespace) and trust for the client network."""
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-dead-clients-")))
    socket_dir = localpg.prepare_base(base / "socket")
    datadir = base / "data"
    srv = LocalServer("server", datadir, 5432, host=str(socket_dir), netns=namespaces[0])
    try:
        localpg.initdb(datadir)
        with (datadir / "postgresql.conf").open("a") as conf:
            conf.write(f"include '{GUEST_SETTINGS}'\n")
        with (datadir / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {CLIENT_ADDRESS}/32 trust\n")
        srv.start(f"listen_addresses={SERVER_ADDRESS}", f"unix_socket_directories={socket_dir}")
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(base, ignore_errors=True)


def backends(srv: LocalServer) -> set[int]:
    with psycopg.connect(srv.dsn, autocommit=True) as conn:
        rows = conn.execute("select pid from pg_stat_activity where backend_type = 'client backend'").fetchall()
    return {int(r[0]) for r in rows}


def test_a_vanished_clients_backend_and_locks_go_within_a_minute(
        namespaces: tuple[str, str], server: LocalServer) -> None:
    _, client_ns = namespaces
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        # From the file, applied (over a unix socket the tcp_* settings themselves read as 0).
        settings: dict[str, str] = dict(conn.execute(
            "select name, setting from pg_file_settings where applied and name in ('tcp_keepalives_idle', "
            "'tcp_keepalives_interval', 'tcp_keepalives_count', 'tcp_user_timeout', "
            "'client_connection_check_interval')").fetchall())
        conn.execute("create table idle_lock(); create table query_lock()")
    assert settings == {"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3",
                        "tcp_user_timeout": "30000", "client_connection_check_interval": "10s"}

    clients: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for mode, table in (("idle", "idle_lock"), ("query", "query_lock")):
            dsn = f"host={SERVER_ADDRESS} port={server.port} user=postgres dbname=postgres connect_timeout=5"
            proc = subprocess.Popen(
                ["ip", "netns", "exec", client_ns, sys.executable, "-c",
                 CLIENT.format(table=table, lifetime=CLIENT_LIFETIME_S), dsn, mode],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            line = proc.stdout.readline()  # once the lock is held
            if not line.strip().isdigit():
                raise AssertionError(f"client ({mode}) did not take its lock: {line}"
                                     f"{proc.stderr.read() if proc.stderr else ''}")
            clients[mode] = (proc, int(line))
        assert {pid for _, pid in clients.values()} <= backends(server)

        # The clients' host vanishes: its link goes down, nothing more reaches the server from it.
        vanished = time.monotonic()
        ip("-n", client_ns, "link", "set", "dc-cli", "down")

        gone_after: dict[str, float] = {}

        def all_gone() -> bool:
            alive = backends(server)
            for mode, (_, pid) in clients.items():
                if pid not in alive and mode not in gone_after:
                    gone_after[mode] = time.monotonic() - vanished
            return len(gone_after) == len(clients)

        # A readiness wait, not a timing target: without the settings this takes about two hours.
        wait_for(all_gone, "both vanished clients' backends to end", 120)
        print("backend gone after the client's link went down: "
              + ", ".join(f"{mode} {seconds:.1f} s" for mode, seconds in sorted(gone_after.items())))
        with psycopg.connect(server.dsn, autocommit=True) as conn:  # their locks are free again
            conn.execute("set lock_timeout = '5s'")
            with conn.transaction():
                conn.execute("lock table idle_lock, query_lock in access exclusive mode")
    finally:
        for proc, _ in clients.values():
            proc.kill()
            proc.wait()
