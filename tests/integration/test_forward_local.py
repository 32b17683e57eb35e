"""The sandbox's loopback forwards (pgcarve.sandbox.forward) against real PostgreSQL 15 servers on
127.0.0.1: a guest name keeps its port, and a forward whose target is down refuses connections
(so libpq 15, psql's, moves on to the next host of a multi-host string) until the target is back.

The forwards run for real, joining this test's own network namespace (as root)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pgcarve.sandbox.forward import ForwardRegistry

from tests.support import localpg
from tests.support.localpg import LocalServer

pytestmark = pytest.mark.localpg

if not localpg.available():  # pragma: no cover - depends on the machine
    pytest.skip("PostgreSQL 15 server binaries are not installed (make apt installs them)", allow_module_level=True)
if os.geteuid() != 0:  # pragma: no cover - depends on the machine
    pytest.skip("a forward joins a network namespace (setns): root only", allow_module_level=True)

OWN_NETNS = f"/proc/{os.getpid()}/ns/net"


@pytest.fixture
def servers() -> Iterator[tuple[LocalServer, LocalServer]]:
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-forward-test-")))
    started: list[LocalServer] = []
    try:
        localpg.initdb(base / "template")
        for name, port in zip(("a", "b"), localpg.free_ports(2), strict=True):
            localpg.clone(base / "template", base / name)
            server = LocalServer(name, base / name, port, client_params={"sslmode": "disable"})
            started.append(server)
            server.start()
            server.wait_ready()
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[ForwardRegistry]:
    forwards = ForwardRegistry(tmp_path / "forwards")
    try:
        yield forwards
    finally:
        forwards.remove_all()  # by the PIDs it recorded


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED


def server_port(dsn: str) -> int:
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        row = conn.execute("select inet_server_port()").fetchone()
    assert row is not None
    return int(row[0])


def wait_until(predicate: object, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def test_a_forward_refuses_while_its_target_is_down_and_keeps_its_port(
    servers: tuple[LocalServer, LocalServer], registry: ForwardRegistry,
) -> None:
    target, other = servers
    forward = registry.ensure("pgc-01", OWN_NETNS, f"127.0.0.1:{target.port}")
    port = registry.port("pgc-01")
    assert forward.port == port
    through = f"host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=disable"
    assert server_port(through) == target.port

    target.stop()
    wait_until(lambda: refused(port), "the forward to refuse once its target is down")
    # psql (libpq 15) takes the next host at once, as for any host that refuses. A forward that
    # accepted and then said nothing would hold psql for the whole connect_timeout (20 s) first:
    # the bound tells the two apart, with room for a loaded machine (psql takes ~0.1 s here).
    both = (f"host=127.0.0.1,127.0.0.1 port={port},{other.port} user=postgres dbname=postgres sslmode=disable "
            "connect_timeout=20")
    started = time.monotonic()
    done = subprocess.run(["psql", "-X", "-At", "-c", "select inet_server_port()", both],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == str(other.port), done.stderr
    assert time.monotonic() - started < 15

    target.start()
    target.wait_ready()
    wait_until(lambda: not refused(port), "the forward to accept again once its target is back")
    assert server_port(through) == target.port
    assert registry.get("pgc-01") == forward, "the same forward process, on the same port"

    registry.remove("pgc-01")  # its guest removed: nothing listens, the name keeps its port
    assert refused(port)
    again = registry.ensure("pgc-01", OWN_NETNS, f"127.0.0.1:{target.port}")
    assert again.port == port and again.pid != forward.pid
    assert server_port(through) == target.port


def test_a_forward_whose_port_was_taken_moves_to_a_new_one(
    servers: tuple[LocalServer, LocalServer], registry: ForwardRegistry,
) -> None:
    target, _ = servers
    port = registry.port("pgc-02")
    with socket.socket() as squatter:  # another program took the port while no forward held it
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        forward = registry.ensure("pgc-02", OWN_NETNS, f"127.0.0.1:{target.port}")
    assert forward.port != port and registry.port("pgc-02") == forward.port
    assert server_port(f"host=127.0.0.1 port={forward.port} user=postgres dbname=postgres sslmode=disable") \
        == target.port
