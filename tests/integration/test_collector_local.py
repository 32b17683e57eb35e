"""Collector against real PostgreSQL 15 servers on 127.0.0.1, checked against pgbench.

Starts two primaries (``a``, ``b``) and a streaming standby of ``a``, all throwaway (fsync off,
trust auth on loopback, autovacuum off so no background transaction lands in the counters),
and stops every one by its postmaster PID whatever happens.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgcarve.control.collector import Collector, Target
from pgcarve.control.rates import RateTracker, Sample, Snapshot
from pgcarve.postgres.session import MANAGER_DATABASE
from pgcarve.postgres.statistics import StandbyState
from psycopg import sql

from tests.support import localpg
from tests.support.localpg import LocalServer

pytestmark = pytest.mark.localpg

PGBENCH = shutil.which("pgbench") or str(localpg.PG_BIN / "pgbench")
PGBENCH_SECONDS = 5
AUTOVACUUM_NAPTIME_S = 4
SETTINGS = ("max_connections=20",)  # on top of localpg.BASE_SETTINGS
INSERT_SCRIPT = "insert into test(info) values (null);\n"

if not localpg.available():  # pragma: no cover - depends on the machine
    pytest.skip("PostgreSQL 15 server binaries are not installed (make apt installs them)", allow_module_level=True)


@dataclass
class Cluster:
    base: Path
    a: LocalServer
    b: LocalServer
    standby: LocalServer
    busy: LocalServer  # autovacuum on, with pgcarve's manager database


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-collector-test-")))
    servers: list[LocalServer] = []
    try:
        localpg.initdb(base / "a")
        localpg.clone(base / "a", base / "b")
        localpg.clone(base / "a", base / "busy")
        port_a, port_b, port_busy, port_standby = localpg.free_ports(4)
        a = LocalServer("a", base / "a", port_a)
        b = LocalServer("b", base / "b", port_b)
        busy = LocalServer("busy", base / "busy", port_busy)
        servers += [a, b, busy]
        for srv in (a, b):
            srv.start(*SETTINGS)
        # Autovacuum at work, visiting each database every AUTOVACUUM_NAPTIME_S.
        busy.start(*SETTINGS, "autovacuum=on", f"autovacuum_naptime={AUTOVACUUM_NAPTIME_S}s",
                   "log_autovacuum_min_duration=0")
        for srv in (a, b, busy):
            srv.wait_ready()
            with psycopg.connect(srv.dsn, autocommit=True) as conn:
                conn.execute("create extension pg_stat_statements")
                conn.execute(localpg.EXPERIMENT_TABLE)
        localpg.run_pg(
            str(localpg.PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(a.port), "-U", "postgres",
            "-D", str(base / "standby"), "-R", "-X", "stream", "--checkpoint=fast", "-N",
        )  # fmt: skip
        standby = LocalServer("standby", base / "standby", port_standby)
        servers.append(standby)
        standby.start(*SETTINGS, "cluster_name=standby1")
        standby.wait_ready()
        with psycopg.connect(busy.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(MANAGER_DATABASE)))
        yield Cluster(base, a, b, standby, busy)
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(base, ignore_errors=True)


def _collector(targets: list[Target], interval_s: float = 1.0) -> Collector:
    return Collector(lambda: targets, RateTracker(), interval_s=interval_s)


def test_idle_servers_read_zero_tps_and_qps(cluster: Cluster) -> None:
    """The collector's own transactions and statements are compensated, even across reconnects.

    Polls 4x faster than PostgreSQL publishes other backends' stats on its own (1 s), which
    only works because the collector forces its own stats out after each poll. The only
    workload is the test's own session that kills the collector's session on 'a': a startup
    transaction plus one statement (2 xacts, 1 call), plus the extension check the collector
    makes when it reconnects (1 call, documented as not compensated). On 'b' the statistics
    are reset mid-run: a re-baseline, never a negative rate, and exact zeros again after it.
    """

    async def scenario() -> list[Snapshot]:
        targets = [Target("a", "local-a", cluster.a.dsn), Target("b", "local-b", cluster.b.dsn)]
        col = _collector(targets)
        snaps = []
        try:
            for i in range(14):
                if i == 3:
                    with psycopg.connect(cluster.b.dsn, autocommit=True) as conn:
                        conn.execute("select pg_stat_reset()")
                if i == 6:
                    with psycopg.connect(cluster.a.dsn, autocommit=True) as conn:
                        conn.execute(
                            "select pg_terminate_backend(pid) from pg_stat_activity"
                            " where application_name = 'pgcarve-collector'"
                        )
                snaps.append(await col.poll_once())
                if i == 6:
                    assert "lost the connection" in col.last_errors()["a"]
                if i == 7:
                    assert col.last_errors() == {}
                await asyncio.sleep(0.25)
        finally:
            await col.aclose()
        return snaps

    snaps = asyncio.run(scenario())
    for name, busy in (("a", (6, 7, 8)), ("b", (3, 4, 5))):
        rates = [s.instances[name] for s in snaps]
        assert sum(r.has_rate for r in rates) >= 11, rates
        assert all(r.tps >= 0.0 and r.qps is not None and r.qps >= 0.0 for r in rates)
        # Intervals away from the test's own interventions are exactly zero.
        quiet = [r for i, r in enumerate(rates) if i not in busy]
        assert all(r.tps == 0.0 and r.qps == 0.0 for r in quiet), (name, quiet)
    # The reset on 'b' was seen as one (the counter went down), not as a rate.
    assert not snaps[3].instances["b"].has_rate
    # On 'a' the whole run adds up to exactly the test's own traffic.
    rates = [s.instances["a"] for s in snaps]
    assert sum(r.tps * r.interval_s for r in rates) == pytest.approx(2.0, abs=1e-6), rates
    assert sum((r.qps or 0.0) * r.interval_s for r in rates) == pytest.approx(2.0, abs=1e-6), rates


def _pgbench_cmd(port: int, script: Path) -> list[str]:
    return [
        PGBENCH, "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
        "-M", "prepared", "-n", "-c", "2", "-j", "2", "-T", str(PGBENCH_SECONDS),
        "-f", str(script), "postgres",
    ]  # fmt: skip


def _parse_pgbench(out: str) -> tuple[int, float]:
    count = re.search(r"number of transactions actually processed: (\d+)", out)
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
    assert count and tps, out
    return int(count.group(1)), float(tps.group(1))


def test_aggregate_tps_matches_pgbench(cluster: Cluster, tmp_path: Path) -> None:
    """Collector TPS over pgbench's run window is within 3% of the sum of pgbench's TPS.

    PostgreSQL 15 backends publish xact counts at most once a second, so a 1 Hz rate lags the
    workload by up to a second. The collector's TPS over the run is therefore the integral of
    its per-instance rates over the polls bracketing the run (baseline before, one poll after
    the backends exited and flushed) divided by pgbench's own run time (N / tps).
    """
    script = tmp_path / "insert.sql"
    script.write_text(INSERT_SCRIPT)
    servers = {"a": cluster.a, "b": cluster.b}

    async def scenario() -> tuple[list[Snapshot], dict[str, str], float, list[Sample]]:
        targets = [Target(name, f"local-{name}", srv.dsn) for name, srv in servers.items()]
        col = _collector(targets)
        samples: list[Sample] = []
        col.on_sample.append(lambda _t, s: samples.append(s))
        stop = asyncio.Event()
        runner = asyncio.create_task(col.run(stop))
        try:
            while len(col.tracker.history(3600)) < 2:
                await asyncio.sleep(0.05)
            start_wall = time.time()
            procs = [
                await asyncio.create_subprocess_exec(
                    *_pgbench_cmd(srv.port, script), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
                )
                for srv in servers.values()
            ]
            outs = await asyncio.gather(*(p.communicate() for p in procs))
            end_wall = time.time()
            for p, (_, err) in zip(procs, outs, strict=True):
                assert p.returncode == 0, err.decode()
            # Two more polls: the first sees the counts the exiting backends flushed.
            while not [s for s in col.tracker.history(3600) if s.at > end_wall + 1.0]:
                await asyncio.sleep(0.05)
            assert col.last_errors() == {}
        finally:
            stop.set()
            await runner
            await col.aclose()
        history = [s for s in col.tracker.history(3600)]
        reports = {name: out.decode() for name, (out, _) in zip(servers, outs, strict=True)}
        return history, reports, start_wall, samples

    history, reports, start_wall, samples = asyncio.run(scenario())
    run = [s for s in history if s.at > start_wall]
    assert len(run) >= PGBENCH_SECONDS + 1
    pgbench_tps_sum = 0.0
    collector_tps_sum = 0.0
    qps_sum = 0.0
    for name, out in reports.items():
        count, tps = _parse_pgbench(out)
        seconds = count / tps
        rates = [s.instances[name] for s in run]
        assert all(r.has_rate for r in rates), rates
        pgbench_tps_sum += tps
        collector_tps_sum += sum(r.tps * r.interval_s for r in rates) / seconds
        qps_sum += sum((r.qps or 0.0) * r.interval_s for r in rates) / seconds
    per_second = [round(s.aggregate_tps) for s in run]
    print(f"pgbench tps sum {pgbench_tps_sum:.1f}; collector {collector_tps_sum:.1f}; per poll {per_second}")
    assert collector_tps_sum == pytest.approx(pgbench_tps_sum, rel=0.03)
    # pg_stat_statements sees the same inserts, minus the collector's own query.
    assert qps_sum == pytest.approx(pgbench_tps_sum, rel=0.03)
    # The aggregate really moved with the load, and samples reached the hook.
    assert max(s.aggregate_tps for s in run) > 0.5 * pgbench_tps_sum
    assert {s.instance for s in samples} == {"a", "b"}


def test_replication_state_and_standby_target(cluster: Cluster) -> None:
    async def scenario() -> tuple[Snapshot, list[StandbyState], Collector]:
        targets = [
            Target("a", "local-a", cluster.a.dsn),
            Target("standby", "local-standby", cluster.standby.dsn),
        ]
        col = _collector(targets)
        try:
            await col.poll_once()
            deadline = time.monotonic() + 10
            while True:
                snap = await col.poll_once()
                standbys = col.replication("a")
                if (standbys and standbys[0].state == "streaming") or time.monotonic() > deadline:
                    return snap, standbys, col
                await asyncio.sleep(0.2)
        finally:
            await col.aclose()

    snap, standbys, col = asyncio.run(scenario())
    assert col.last_errors() == {}
    assert len(standbys) == 1
    st = standbys[0]
    assert st.application_name == "standby1"
    assert st.state == "streaming"
    assert st.sync_state == "async"
    assert st.client_addr == "127.0.0.1/32"
    assert st.lag_bytes is not None and st.lag_bytes >= 0
    assert snap.instances["a"].replay_lag_bytes == st.lag_bytes
    # In recovery: no primary-side lag and no error from pg_current_wal_lsn().
    assert snap.instances["standby"].replay_lag_bytes is None
    assert snap.instances["standby"].has_rate
    assert col.replication("standby") == []
    assert col.replication("unknown") == []


def _collector_sessions(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity where application_name = 'pgcarve-collector'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_unreachable_target_missing_extension_and_vanishing(cluster: Cluster) -> None:
    async def scenario() -> None:
        dead_port = localpg.free_ports(1)[0]
        targets = [
            Target("b", "local-b", cluster.b.dsn),
            # template1 has no pg_stat_statements extension: calls must be None, not an error.
            Target("nopgss", "local-a", cluster.a.dsn.replace("dbname=postgres", "dbname=template1")),
            Target("dead", "nowhere", f"host=127.0.0.1 port={dead_port} user=postgres dbname=postgres"),
        ]
        col = _collector(targets)
        try:
            await col.poll_once()
            snap = await col.poll_once()
            errors = col.last_errors()
            assert set(errors) == {"dead"}
            assert errors["dead"].startswith("cannot connect to PostgreSQL on nowhere:")
            assert "dead" not in snap.instances
            assert snap.instances["nopgss"].qps is None
            assert snap.instances["nopgss"].has_rate
            assert snap.instances["b"].qps == 0.0
            # One session of this collector (an earlier test's may still be ending).
            deadline = time.monotonic() + 5
            while _collector_sessions(cluster.a.dsn) > 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _collector_sessions(cluster.a.dsn) == 1
            # Scale down: both leave the aggregate and the error list at once, and the
            # connection of the one that was reachable is closed.
            del targets[1:]
            snap = await col.poll_once()
            assert set(snap.instances) == {"b"}
            assert col.last_errors() == {}
            deadline = time.monotonic() + 5
            while _collector_sessions(cluster.a.dsn) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _collector_sessions(cluster.a.dsn) == 0
        finally:
            await col.aclose()

    asyncio.run(scenario())


def test_hung_target_does_not_slow_the_rounds(cluster: Cluster) -> None:
    """A host that accepts TCP but never answers (a paused guest) must not stall other targets."""

    async def scenario() -> None:
        async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # never answers, until the client gives up
            writer.close()

        server = await asyncio.start_server(swallow, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        targets = [
            Target("b", "local-b", cluster.b.dsn),
            Target("hung", "paused-guest", f"host=127.0.0.1 port={port} user=postgres dbname=postgres"),
        ]
        # The hung connect gives up after 8 s; a round waits at most 0.9 x interval (0.45 s). A
        # round that waited for the hung target would take the whole 8 s: the bound below (4 s)
        # tells the two apart with room for a loaded machine, where 0.45 s can become 2 s.
        col = Collector(lambda: targets, RateTracker(), interval_s=0.5, connect_timeout_s=8)
        try:
            durations: list[float] = []
            deadline = time.monotonic() + 60
            while "hung" not in col.last_errors() or len(durations) < 6:
                assert time.monotonic() < deadline, f"no error for the hung target after 60 s: {durations}"
                t0 = time.monotonic()
                snap = await col.poll_once()
                durations.append(time.monotonic() - t0)
            print(f"{len(durations)} rounds beside a hung target, the longest {max(durations):.2f} s")
            assert max(durations) < 4, durations
            assert snap.instances["b"].has_rate
            assert "hung" not in snap.instances
            assert col.last_errors()["hung"] == "cannot connect to PostgreSQL on paused-guest: no answer within 8 s"
            # Scaled down while its poll is in flight: cancelled, error gone, nothing left running.
            del targets[1:]
            await col.poll_once()
            assert col.last_errors() == {}
        finally:
            await col.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_client_counts_leave_out_autovacuum_and_the_manager_database(cluster: Cluster) -> None:
    """What clients do is counted; autovacuum's work and pgcarve's own sessions are not.

    On a server with autovacuum on: pgcarve's manager database gets 60 statements, and a client
    fills 20 tables past autovacuum's insert and analyze thresholds (one session: a start-up
    and 40 statements = 41 transactions). Autovacuum then vacuums and analyzes all 20 (three
    transactions each, two per visit). The collector's client count must grow by the client's
    41 alone, give or take what it documents it cannot see: two transactions per autovacuum
    visit that found no work between two polls (at most one visit per naptime here).
    """
    tables = 20
    busy = cluster.busy
    manager_dsn = busy.dsn.replace("dbname=postgres", f"dbname={MANAGER_DATABASE}")

    checks = 0

    def autovacuum_done(conn: psycopg.Connection[tuple[Any, ...]]) -> bool:
        # The test's own reads are client work too: one transaction each (counted below).
        nonlocal checks
        checks += 1
        row = conn.execute(
            "select count(*) filter (where autovacuum_count > 0 and autoanalyze_count > 0),"
            " (select count(*) from pg_stat_activity where backend_type = 'autovacuum worker')"
            " from pg_stat_user_tables where relname like 'filled%'").fetchone()
        assert row is not None
        return bool(row[0] == tables and row[1] == 0)

    async def scenario() -> tuple[Snapshot, Snapshot, list[Sample], float]:
        col = _collector([Target("busy", "local-busy", busy.dsn)], interval_s=0.5)
        samples: list[Sample] = []
        col.on_sample.append(lambda _t, sample: samples.append(sample))
        try:
            await col.poll_once()
            await asyncio.sleep(0.5)
            start = await col.poll_once()
            started = time.monotonic()
            with psycopg.connect(manager_dsn, autocommit=True) as conn:
                for _ in range(60):
                    conn.execute("select 1")
            with psycopg.connect(busy.dsn, autocommit=True) as conn:
                for k in range(tables):
                    conn.execute(f"create table filled{k}(id int)")
                    conn.execute(f"insert into filled{k} select generate_series(1, 2000)")
                deadline = time.monotonic() + 60
                while not await asyncio.to_thread(autovacuum_done, conn):
                    assert time.monotonic() < deadline, "autovacuum did not process the tables in 60 s"
                    await col.poll_once()
                    await asyncio.sleep(0.5)
            for _ in range(4):  # past the worker's exit, when its transactions are published
                end = await col.poll_once()
                await asyncio.sleep(0.5)
            assert col.last_errors() == {}
            return start, end, samples, time.monotonic() - started
        finally:
            await col.aclose()

    start, end, samples, elapsed = asyncio.run(scenario())
    made = 41 + checks  # the session's start-up, 40 statements, and the test's reads in it
    client = end.xacts_total - start.xacts_total
    all_xacts = (samples[-1].all_xacts or 0) - (samples[1].all_xacts or 0)
    unseen_visits = int(elapsed / AUTOVACUUM_NAPTIME_S) + 1
    print(f"client transactions counted {client} (the client made {made}); everything PostgreSQL counted "
          f"{all_xacts} over {elapsed:.1f} s; at most {unseen_visits} idle autovacuum visits unseen")
    # Autovacuum's 20 x 3 + 2 and the manager's 61 are in PostgreSQL's count, not in the client's.
    assert all_xacts >= made + 61 + tables * 3 + 2
    assert made <= client <= made + 2 * unseen_visits
    # Per-second rates never went negative while autovacuum's counts ran ahead of its transactions.
    assert all(later.xacts >= earlier.xacts for earlier, later in itertools.pairwise(samples))
