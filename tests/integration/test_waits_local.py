"""The wait sampler (control/waits.py) against a real PostgreSQL 15 on 127.0.0.1: sessions put in
known states (a commit waiting for a synchronous standby that never comes, a query blocked on a
lock, a sleep, idle sessions) come out in the right categories, and pgcarve's own sessions do not
come out at all."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pgcarve.control.collector import Target
from pgcarve.control.waits import APPLICATION_NAME, WaitBreakdown, WaitSampler
from pgcarve.postgres.session import MANAGER_DATABASE

from tests.integration.conftest import wait_for
from tests.support import localpg
from tests.support.localpg import LocalServer

pytestmark = pytest.mark.localpg

if not localpg.available():  # pragma: no cover - depends on the machine
    pytest.skip("PostgreSQL 15 server binaries are not installed (make apt installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-waits-test-")))
    localpg.initdb(base / "w")
    srv = LocalServer("w", base / "w", localpg.free_ports(1)[0])
    # A synchronous standby that never connects: a commit with synchronous_commit=on waits forever.
    srv.start("synchronous_standby_names=nobody")
    try:
        srv.wait_ready()
        with psycopg.connect(srv.dsn, autocommit=True) as conn:
            conn.execute(localpg.EXPERIMENT_TABLE)
            conn.execute("create table probe(info text)")
        yield srv
    finally:
        srv.stop()


def sample(target: Target, at_least: int, timeout_s: float = 20.0) -> WaitBreakdown:
    """Run a sampler until it holds `at_least` samples of `target` (bounded by `timeout_s`)."""

    async def go() -> WaitBreakdown:
        sampler = WaitSampler(lambda: [target], rate_hz=20, window_s=60)
        stop = asyncio.Event()
        task = asyncio.create_task(sampler.run(stop, reconcile_s=0.2))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                found = sampler.breakdown(target.instance)
                if found is not None and found.samples >= at_least:
                    return found
                await asyncio.sleep(0.05)
            raise AssertionError(f"fewer than {at_least} samples in {timeout_s} s: "
                                 f"{sampler.breakdown(target.instance)}")
        finally:
            stop.set()
            await task

    return asyncio.run(go())


def test_sessions_land_in_their_categories(server: LocalServer) -> None:
    target = Target(instance="w", host="127.0.0.1", dsn=server.dsn)
    waiter = psycopg.connect(server.dsn, autocommit=True)
    holder = psycopg.connect(server.dsn)
    blocked = psycopg.connect(server.dsn, autocommit=True)
    idle = psycopg.connect(server.dsn, autocommit=True)
    pids = [c.info.backend_pid for c in (waiter, blocked)]
    try:
        holder.execute("lock table test in access exclusive mode")  # idle in transaction: "client"
        waiter.execute("set synchronous_commit = on")
        for conn, statement in ((waiter, "insert into probe values ('waits for a standby')"),
                                (blocked, "select count(*) from test")):
            conn.pgconn.send_query(statement.encode())  # runs on in the server; read nothing back

        def settled() -> bool:
            """Both statements have reached their waits (until then a session reads as client or CPU)."""
            with psycopg.connect(server.dsn, autocommit=True) as check:
                found = check.execute("select pid, wait_event from pg_stat_activity where pid = any(%s)",
                                      (pids,)).fetchall()
            rows: dict[int, str | None] = dict(found)
            return rows.get(pids[0]) == "SyncRep" and rows.get(pids[1]) == "relation"

        wait_for(settled, "the insert to wait for its standby and the select for its lock", 30)
        found = sample(target, at_least=10)
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            for pid in pids:
                admin.execute("select pg_cancel_backend(%s)", (pid,))
        for conn in (waiter, holder, blocked, idle):
            conn.close()
    # Four client sessions per sample: SyncRep, lock, and two waiting for their client.
    assert found.sessions == 4 * found.samples
    assert found.shares["SyncRep"] == pytest.approx(0.25)
    assert found.shares["lock"] == pytest.approx(0.25)
    assert found.shares["client"] == pytest.approx(0.5)
    assert found.dominant == "client" and found.error is None
    assert "SyncRep 25%" in found.summary()


def test_own_sessions_are_left_out(server: LocalServer) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"create database {MANAGER_DATABASE}")
    try:
        found = sample(Target(instance="w", host="127.0.0.1", dsn=server.dsn), at_least=5)
        assert found.sessions == 0 and found.summary().startswith("no client session")

        def sampler_sessions() -> list[tuple[object, ...]]:
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                return conn.execute("select datname from pg_stat_activity where application_name = %s",
                                    (APPLICATION_NAME,)).fetchall()

        # The sampler closed its session when it stopped; the server's backend exits just after.
        wait_for(lambda: sampler_sessions() == [], "the sampler's session to end", 10)
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"drop database {MANAGER_DATABASE} with (force)")
