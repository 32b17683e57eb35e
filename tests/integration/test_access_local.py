"""Who gets in, checked on real PostgreSQL 15 servers on 127.0.0.1 (tests/support/localpg.py): a
primary and a streaming standby with TLS certificates from a fleet CA, pg_hba.conf in pgcarve's
shape (hostssl only), the application role made by the image's first-boot SQL, replication rules
rewritten by postgres/hba.py, and the instance's multi-host URIs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from pgcarve.control.endpoints import application_uris
from pgcarve.guest.tls import FleetCA
from pgcarve.postgres import hba
from pgcarve.postgres.session import ClientTls

from tests.support import localpg
from tests.support.guest_script import load_guest_setup
from tests.support.localpg import LocalServer
from tests.support.seeds import SECRETS, guest_seed

pytestmark = pytest.mark.localpg

if not localpg.available():  # pragma: no cover - depends on the machine
    pytest.skip("PostgreSQL 15 server binaries are not installed (make apt installs them)", allow_module_level=True)

# pgcarve's shape (pgcarve-guest-setup's pg_hba), with the image's peer logins replaced by a
# superuser over TLS from loopback: the tests' own way in.
PG_HBA = """\
hostssl all postgres 127.0.0.1/32 trust
hostssl replication postgres 127.0.0.1/32 trust
hostssl app app 127.0.0.1/32 scram-sha-256
"""


@dataclass
class Servers:
    primary: LocalServer
    standby: LocalServer
    tls: ClientTls
    base: Path

    def dsn(self, server: LocalServer, **params: str) -> str:
        return psycopg.conninfo.make_conninfo(server.dsn, **params)

    def admin(self, server: LocalServer) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.dsn(server), autocommit=True)


def _private_to_postgres(path: Path, data: bytes, mode: int) -> None:
    path.write_bytes(data)
    path.chmod(mode)
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-access-test-")))
    started: list[LocalServer] = []
    try:
        ca = FleetCA(base / "tls")
        ca.create()
        issued = ca.issue_server_certificate(["pgc-01"])
        _private_to_postgres(base / "server.crt", issued.cert_pem, 0o644)
        _private_to_postgres(base / "server.key", issued.key_pem, 0o600)
        tls = ClientTls(str(ca.cert_file))
        ssl = ("ssl=on", f"ssl_cert_file={base / 'server.crt'}", f"ssl_key_file={base / 'server.key'}",
               "password_encryption=scram-sha-256", "max_connections=30")
        port_primary, port_standby = localpg.free_ports(2)
        localpg.initdb(base / "primary")
        _private_to_postgres(base / "primary" / "pg_hba.conf", PG_HBA.encode(), 0o640)
        # The postgres user's libpq (pg_basebackup, the standby's walreceiver) looks for client
        # certificates under HOME: one it can read.
        env = dict(os.environ, HOME=str(base), **tls.environment())
        primary = LocalServer("primary", base / "primary", port_primary, client_params=tls.params())
        started.append(primary)
        primary.start(*ssl, env=env)
        primary.wait_ready()
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("create role pgcarve login superuser")  # as the image makes them
            conn.execute("create role replicator login replication")
        clone = subprocess.run(
            [str(localpg.PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(port_primary), "-U", "postgres",
             "-D", str(base / "standby"), "-R", "-X", "stream", "--checkpoint=fast", "-N"],
            capture_output=True, text=True, env=env, check=False, **localpg.as_postgres())  # fmt: skip
        assert clone.returncode == 0, clone.stderr
        standby = LocalServer("standby", base / "standby", port_standby, client_params=tls.params())
        started.append(standby)
        standby.start(*ssl, "cluster_name=standby1", env=env)
        standby.wait_ready()
        yield Servers(primary, standby, tls, base)
    finally:
        for server in started:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)


def psql(servers: Servers, conninfo: str, sql: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
    """psql (libpq 15) with `sql` on stdin; the password in its environment only."""
    env = dict(os.environ, **({"PGPASSWORD": password} if password else {}))
    return subprocess.run(["psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", conninfo], input=sql, text=True,
                          capture_output=True, env=env, timeout=60, check=False)


@pytest.fixture(scope="module")
def app_role(servers: Servers) -> None:
    """The image's first-boot SQL (pgcarve-guest-setup first_boot_sql), run twice: it is safe to repeat."""
    setup = load_guest_setup()
    seed = guest_seed("pgc-01", "primary").instance_json()
    for _ in range(2):
        done = psql(servers, servers.dsn(servers.primary), setup.first_boot_sql(seed))
        assert done.returncode == 0, done.stderr
    with servers.admin(servers.standby) as conn:  # replicated before any test reads there
        deadline = time.monotonic() + 30
        while conn.execute("select 1 from pg_database where datname = 'app'").fetchone() is None:
            assert time.monotonic() < deadline, "the standby did not replay the application role in 30 s"
            time.sleep(0.1)


def test_the_application_role_owns_its_database_and_nothing_more(servers: Servers, app_role: None) -> None:
    with servers.admin(servers.primary) as conn:
        role = conn.execute("select rolsuper, rolreplication, rolcreatedb, rolcreaterole, rolbypassrls "
                            "from pg_roles where rolname = 'app'").fetchone()
        owner = conn.execute("select pg_get_userbyid(datdba) from pg_database where datname = 'app'").fetchone()
    assert role == (False, False, False, False, False) and owner == ("app",)
    app = servers.dsn(servers.primary, user="app", dbname="app", password=SECRETS.app_password)
    with psycopg.connect(app, autocommit=True) as conn:
        conn.execute("create table if not exists notes (id int primary key)")
        assert conn.execute("select current_user, current_setting('is_superuser')").fetchone() == ("app", "off")
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(servers.dsn(servers.primary, user="app", dbname="app", password="not" + SECRETS.app_password))
    for other in ("postgres", "pgcarve", "template1"):
        with pytest.raises(psycopg.OperationalError, match=r"no pg_hba\.conf entry"):
            psycopg.connect(servers.dsn(servers.primary, user="app", dbname=other, password=SECRETS.app_password))
    # Replication protocol, as pg_basebackup would ask: no rule lets the application role in.
    refused = psql(servers, servers.dsn(servers.primary, user="app", replication="true"), "IDENTIFY_SYSTEM",
                   SECRETS.app_password)
    assert refused.returncode != 0 and "no pg_hba.conf entry for replication connection" in refused.stderr


def test_tls_is_required_and_verified_with_the_fleet_ca(servers: Servers, tmp_path: Path) -> None:
    with servers.admin(servers.primary) as conn:
        row = conn.execute("select ssl, version from pg_stat_ssl where pid = pg_backend_pid()").fetchone()
    assert row is not None and row[0] is True and str(row[1]).startswith("TLSv1.")
    with pytest.raises(psycopg.OperationalError, match=r"no pg_hba\.conf entry .*no encryption"):
        psycopg.connect(servers.dsn(servers.primary, sslmode="disable"))
    stranger = FleetCA(tmp_path / "other-ca")
    stranger.create()
    with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
        psycopg.connect(servers.dsn(servers.primary, sslrootcert=str(stranger.cert_file)))
    # verify-full where the name matches: the certificate names the guest, not an address.
    ok = f"host=pgc-01 hostaddr=127.0.0.1 port={servers.primary.port} user=postgres dbname=postgres"
    with psycopg.connect(ok, sslmode="verify-full", sslrootcert=servers.tls.root_cert) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    with pytest.raises(psycopg.OperationalError, match="does not match host name"):
        psycopg.connect(servers.dsn(servers.primary, sslmode="verify-full"))


def test_replication_is_let_in_from_the_listed_addresses_only(servers: Servers, app_role: None) -> None:
    setup = load_guest_setup()
    replicate = servers.dsn(servers.primary, user="replicator", replication="true")

    def identify(password: str) -> subprocess.CompletedProcess[str]:
        return psql(servers, replicate, "IDENTIFY_SYSTEM", password)

    with servers.admin(servers.primary) as conn:
        assert hba.allow_standbys(conn, ["10.77.1.23"]) == ["10.77.1.23"]
        assert hba.replication_addresses(conn) == ["10.77.1.23"]
        refused = identify(SECRETS.replication_password)
        assert "no pg_hba.conf entry for replication connection" in refused.stderr, refused.stderr
        hba.allow_standbys(conn, ["127.0.0.1", "10.77.1.23", "127.0.0.1"])
        assert sorted(hba.replication_addresses(conn)) == ["10.77.1.23", "127.0.0.1"]
        allowed = identify(SECRETS.replication_password)
        assert allowed.returncode == 0, allowed.stderr
        assert "password authentication failed" in identify("not" + SECRETS.replication_password).stderr
        listed = Path(str(conn.execute("select current_setting('hba_file')").fetchone()[0])).with_name(  # type: ignore[index]
            hba.STANDBYS_FILE_NAME)
        # What the guest composes pg_hba.conf from at its next boot: the same addresses.
        assert setup.standby_addresses(listed) == ["10.77.1.23", "127.0.0.1"]
        hba.allow_standbys(conn, [])
        assert hba.replication_addresses(conn) == []
        assert "no pg_hba.conf entry for replication connection" in identify(SECRETS.replication_password).stderr
    # A hot standby takes the same rewrite (a standby is made ready for a promotion).
    with servers.admin(servers.standby) as conn:
        assert conn.execute("select pg_is_in_recovery()").fetchone() == (True,)
        hba.allow_standbys(conn, ["10.77.2.40"])
        assert hba.replication_addresses(conn) == ["10.77.2.40"]
        hba.allow_standbys(conn, [])


def test_the_endpoints_find_the_primary_and_a_standby(servers: Servers, app_role: None) -> None:
    """The instance's URIs over [a host where nothing listens, the standby, the primary]: rw
    reaches the primary, ro the standby (where writes are refused), for psycopg and for psql
    (libpq 15, which moves on from a refused host)."""
    dead = localpg.free_ports(1)[0]
    uris = application_uris([("127.0.0.1", dead), ("127.0.0.1", servers.standby.port),
                             ("127.0.0.1", servers.primary.port)], servers.tls)
    with psycopg.connect(uris.rw, password=SECRETS.app_password, autocommit=True) as conn:
        assert conn.execute("select pg_is_in_recovery(), inet_server_port()").fetchone() == (
            False, servers.primary.port)
        conn.execute("create table if not exists notes (id int primary key)")
        conn.execute("insert into notes values (1) on conflict do nothing")
    with psycopg.connect(uris.ro, password=SECRETS.app_password, autocommit=True) as conn:
        assert conn.execute("select pg_is_in_recovery()").fetchone() == (True,)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("create table refused (id int)")
    for uri, port in ((uris.rw, servers.primary.port), (uris.ro, servers.standby.port)):
        done = psql(servers, uri, "select inet_server_port()", SECRETS.app_password)
        assert done.returncode == 0 and done.stdout.strip() == str(port), done.stderr

