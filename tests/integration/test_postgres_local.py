"""pgcarve's statements for tuning and inspecting a server, the experiment's tables and the
synchronous-standby check, against real PostgreSQL 15 servers on 127.0.0.1 (tests/support/localpg.py):
a primary and a streaming standby of it, which the primary names as synchronous."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from pgcarve.errors import ConfigError
from pgcarve.postgres import admin, pgbench, replication
from pgcarve.postgres.session import Connection

from tests.support import localpg
from tests.support.localpg import LocalServer

pytestmark = pytest.mark.localpg

if not localpg.available():  # pragma: no cover - depends on the machine
    pytest.skip("PostgreSQL 15 server binaries are not installed (make apt installs them)", allow_module_level=True)


@dataclass
class Pair:
    primary: LocalServer
    standby: LocalServer


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-postgres-test-")))
    servers: list[LocalServer] = []
    try:
        port_primary, port_standby = localpg.free_ports(2)
        localpg.initdb(base / "primary")
        primary = LocalServer("primary", base / "primary", port_primary)
        servers.append(primary)
        # Every commit waits for the standby, as on a pgcarve primary; remote_apply (pgcarve's
        # default is remote_write) so that a committed row can be read on the standby at once.
        primary.start("max_connections=20", "synchronous_commit=remote_apply", "synchronous_standby_names=standby1")
        primary.wait_ready()
        localpg.run_pg(
            str(localpg.PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(port_primary), "-U", "postgres",
            "-D", str(base / "standby"), "-R", "-X", "stream", "--checkpoint=fast", "-N",
        )  # fmt: skip
        standby = LocalServer("standby", base / "standby", port_standby)
        servers.append(standby)
        standby.start("max_connections=20", "cluster_name=standby1")  # its application_name upstream
        standby.wait_ready()
        yield Pair(primary, standby)
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(base, ignore_errors=True)


def connect(server: LocalServer) -> Connection:
    return psycopg.connect(server.dsn, autocommit=True)


def test_settings_a_reload_applies_are_set_and_the_others_reported(pair: Pair) -> None:
    with connect(pair.primary) as conn:
        change = admin.alter_settings(conn, {"work_mem": "8MB", "shared_buffers": "64MB", "no_such_setting": "1"})
        assert change.applied == {"work_mem": "8MB"}
        assert change.not_applied == {"shared_buffers": "needs a restart (postmaster); not applied",
                                      "no_such_setting": "unknown setting"}
        effective = admin.effective_settings(conn, ["work_mem", "shared_buffers", "no_such_setting"])
        assert effective == {"work_mem": "8192 x kB", "shared_buffers": "2048 x 8kB"}
        admin.alter_settings(conn, {"work_mem": "4MB"})
        assert admin.effective_settings(conn, ["work_mem"]) == {"work_mem": "4096 x kB"}


def test_server_facts(pair: Pair) -> None:
    with connect(pair.primary) as conn:
        assert admin.server_version(conn).startswith("PostgreSQL 15.")
        assert admin.read_server_file(conn, "/proc/version", 4096) == Path("/proc/version").read_text()[:4096]
        assert admin.read_server_file(conn, "/proc/stat").startswith("cpu ")


def test_experiment_tables_scripts_and_the_sync_standby(pair: Pair) -> None:
    with connect(pair.primary) as conn:
        deadline = time.monotonic() + 30
        while not replication.streaming_synchronous_standbys(conn):
            assert time.monotonic() < deadline, "the standby did not stream as synchronous within 30 s"
            time.sleep(0.1)
        assert replication.streaming_synchronous_standbys(conn) == ["standby1"]
        for table in ("test", "test2"):
            pgbench.create_test_table(conn, table)
            pgbench.create_test_table(conn, table)  # exists already: nothing happens
            pgbench.insert_row(conn, f"probe of {table}", table)  # waits for the synchronous standby
            conn.execute(pgbench.insert_script(table))
        assert pgbench.insert_script() == pgbench.INSERT_SCRIPT
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute(pgbench.insert_script("test3"))
    with connect(pair.standby) as conn:
        rows = conn.execute("select info from test2 order by id").fetchall()
    assert rows == [("probe of test2",), (None,)], "committed on the primary, so already on its sync standby"


def test_a_write_fence_says_why_and_lifts(pair: Pair) -> None:
    """refuse_writes (scale-down, switchover) keeps its reason beside the setting, so the API can
    report it and the primary watch can lift one an interrupted operation left; allow_writes undoes
    both, and the collector's poll reports the fence as it holds."""
    from pgcarve.postgres.statistics import PollRow, poll_statement

    with connect(pair.primary) as conn:
        assert replication.write_fence(conn) is None
        replication.refuse_writes(conn, "scale-down")
    with connect(pair.primary) as conn:  # a new session, as the collector's and clients' are
        assert replication.write_fence(conn) == "scale-down"
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            pgbench.create_test_table(conn, "fenced")
        row = conn.execute(poll_statement(None, False), {"since": None, "before": None}).fetchone()
        assert row is not None and PollRow.parse(row).write_fence == "scale-down"
        replication.allow_writes(conn)
    with connect(pair.primary) as conn:
        assert replication.write_fence(conn) is None
        row = conn.execute(poll_statement(None, False), {"since": None, "before": None}).fetchone()
        assert row is not None and PollRow.parse(row).write_fence is None
        conn.execute("alter system set default_transaction_read_only = on")  # someone else's, no reason
        conn.execute("select pg_reload_conf()")
    with connect(pair.primary) as conn:
        assert replication.write_fence(conn) is None, "only pgcarve's own fence is lifted by pgcarve"
        row = conn.execute(poll_statement(None, False), {"since": None, "before": None}).fetchone()
        assert row is not None and PollRow.parse(row).write_fence == "read-only by configuration"
        conn.execute("alter system reset default_transaction_read_only")
        conn.execute("select pg_reload_conf()")


@pytest.mark.parametrize("table", ["Test", "test;drop", "1test", "x" * 64, ""])
def test_table_names_are_checked(table: str) -> None:
    with pytest.raises(ConfigError, match="table name"):
        pgbench.insert_script(table)
