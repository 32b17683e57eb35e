"""Applications connect, in the shared 3-host sandbox: the API's endpoint URIs and credentials,
TLS everywhere, an application role confined to its own instance and database, replication
accepted only from an instance's own guests, `pgcarve connect | dsn | service-file`, and, last,
`pgcarve purge` of a retired instance.

Runs after test_carve.py, on the two instances it leaves (cross-instance checks need a second
one); booting a second instance anew would cost minutes under emulation. The last test scales to
1 and purges pgc-02, so test_faults.py starts from pgc-01 alone. Tests run in file order and share
the guests.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import libvirt_qemu
import psycopg
import pytest
from pgcarve.control.fleet import Fleet, Guest
from pgcarve.control.removal import leftovers
from pgcarve.guest.tls import FleetCA
from pgcarve.postgres import hba
from pgcarve.postgres.conninfo import GUEST_CA_FILE
from pgcarve.sandbox.forward import ForwardRegistry
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.integration.conftest import IT_STATE, TOKEN, CarveEnv, wait_for, wait_operation

pytestmark = pytest.mark.integration


def api_get(env: CarveEnv, path: str, token: str | None = TOKEN) -> Any:
    with env.client(token=token) as client:
        resp = client.get(path)
        assert resp.status_code == 200, (path, resp.status_code, resp.text)
        return resp.json()


def scale(env: CarveEnv, instances: int) -> None:
    with env.client() as client:
        resp = client.put("/v1/scale", json={"instances": instances})
        assert resp.status_code == 202, resp.text
    op = wait_operation(env, resp.json()["operation"], 1500)
    assert op["status"] == "succeeded", op


@pytest.fixture(scope="module", autouse=True)
def two_instances(carve_env: CarveEnv) -> None:
    """pgc-01 and pgc-02 with their standbys: left by test_carve.py, or made here when run alone.
    The module's last test scales back to 1 and purges pgc-02 (test_faults.py starts from pgc-01)."""
    if [d["name"] for d in api_get(carve_env, "/v1/instances")] != ["pgc-01", "pgc-02"]:
        scale(carve_env, 2)


@pytest.fixture()
def fleet(carve_env: CarveEnv) -> Iterator[Fleet]:
    f = Fleet(carve_env.config, carve_env.paths)
    yield f
    f.close()


def endpoints(env: CarveEnv, name: str) -> dict[str, str]:
    doc = wait_for(lambda: (d := api_get(env, f"/v1/instances/{name}")) and d["endpoints"] and d,
                   f"{name}'s endpoints", 60)
    return dict(doc["endpoints"])


def credentials(env: CarveEnv, name: str) -> dict[str, str]:
    return dict(api_get(env, f"/v1/instances/{name}/credentials"))


def connect(uri: str, password: str, **params: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(make_conninfo(uri, password=password, **params), autocommit=True, connect_timeout=10)


def test_instances_have_endpoints_over_all_their_guests(carve_env: CarveEnv) -> None:
    forwards = ForwardRegistry(carve_env.paths.sandbox_dir / "forwards")
    for name in ("pgc-01", "pgc-02"):
        uris = endpoints(carve_env, name)
        guests = [name, f"{name}-s1", f"{name}-s2"]
        for kind, attrs in (("rw", "read-write"), ("ro", "prefer-standby")):
            parsed = conninfo_to_dict(uris[kind])
            assert parsed["host"] == ",".join(["127.0.0.1"] * 3)
            assert parsed["port"] == ",".join(str(forwards.port(g)) for g in guests)
            assert (parsed["user"], parsed["dbname"], parsed["target_session_attrs"]) == ("app", "app", attrs)
            assert (parsed["sslmode"], parsed["sslrootcert"]) == ("verify-ca", str(carve_env.paths.tls_dir / "ca.pem"))
            assert "password" not in parsed
    listed = {d["name"]: d["endpoints"] for d in api_get(carve_env, "/v1/instances")}
    assert listed["pgc-01"] == endpoints(carve_env, "pgc-01")
    print(f"endpoints of pgc-01: rw {listed['pgc-01']['rw']}")


def test_credentials_need_the_token_even_on_loopback(carve_env: CarveEnv) -> None:
    with carve_env.client(token=None) as anonymous:
        assert anonymous.get("/v1/instances/pgc-01").status_code == 200, "reads are open on loopback"
        assert anonymous.get("/v1/instances/pgc-01/credentials").status_code == 401
    one, two = credentials(carve_env, "pgc-01"), credentials(carve_env, "pgc-02")
    assert (one["user"], one["database"]) == ("app", "app")
    assert one["password"] != two["password"]
    assert one["password"] not in (IT_STATE / "server.log").read_text(errors="replace")


def test_writes_go_through_rw_and_reads_through_ro(carve_env: CarveEnv) -> None:
    uris, password = endpoints(carve_env, "pgc-01"), credentials(carve_env, "pgc-01")["password"]
    marker = uuid.uuid4().hex
    with connect(uris["rw"], password) as conn:
        row = conn.execute("select pg_is_in_recovery(), current_user, current_setting('is_superuser'), "
                           "(select ssl from pg_stat_ssl where pid = pg_backend_pid())").fetchone()
        assert row == (False, "app", "off", True)
        conn.execute("create table if not exists notes (id bigserial primary key, marker text)")
        conn.execute("insert into notes (marker) values (%s)", (marker,))
    with connect(uris["ro"], password) as conn:
        assert conn.execute("select pg_is_in_recovery(), (select ssl from pg_stat_ssl "
                            "where pid = pg_backend_pid())").fetchone() == (True, True)

        def replayed() -> bool:
            return conn.execute("select count(*) from notes where marker = %s", (marker,)).fetchone() == (1,)

        wait_for(replayed, "the row written through rw to be read through ro", 60)
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("insert into notes (marker) values ('through ro')")


def test_the_application_role_is_confined_to_its_instance(carve_env: CarveEnv, fleet: Fleet) -> None:
    one, two = endpoints(carve_env, "pgc-01"), endpoints(carve_env, "pgc-02")
    password = credentials(carve_env, "pgc-01")["password"]
    with pytest.raises(psycopg.OperationalError, match='password authentication failed for user "app"'):
        connect(two["rw"], password)
    for database in ("postgres", "pgcarve"):
        with pytest.raises(psycopg.OperationalError, match=r"no pg_hba\.conf entry"):
            connect(one["rw"], password, dbname=database)
    replication = make_conninfo(one["rw"], replication="true", connect_timeout="10")
    refused = subprocess.run(["psql", "-X", "-At", "-c", "IDENTIFY_SYSTEM", replication], capture_output=True,
                             text=True, env=dict(os.environ, PGPASSWORD=password), timeout=60, check=False)
    assert refused.returncode != 0 and "no pg_hba.conf entry for replication connection" in refused.stderr, refused
    inst = fleet.instance("pgc-01")
    assert inst.primary is not None
    with fleet.connect(inst.primary) as conn:
        role = conn.execute("select rolsuper, rolreplication, rolcreatedb, rolcreaterole "
                            "from pg_roles where rolname = 'app'").fetchone()
        owner = conn.execute("select pg_get_userbyid(datdba) from pg_database where datname = 'app'").fetchone()
    assert role == (False, False, False, False) and owner == ("app",)


def test_tls_is_required_and_verified_with_the_fleet_ca(carve_env: CarveEnv, tmp_path: Path) -> None:
    uri = endpoints(carve_env, "pgc-01")["rw"]
    password = credentials(carve_env, "pgc-01")["password"]
    with pytest.raises(psycopg.OperationalError, match=r"no pg_hba\.conf entry .*no encryption"):
        connect(uri, password, sslmode="disable")
    stranger = FleetCA(tmp_path / "other-ca")
    stranger.create()
    with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
        connect(uri, password, sslrootcert=str(stranger.cert_file))
    # verify-full where the name matches: the guest's certificate names the guest and its instance.
    port = str(conninfo_to_dict(uri)["port"]).split(",")[0]  # pgc-01's own forward
    full = (f"host=pgc-01 hostaddr=127.0.0.1 port={port} user=app dbname=app sslmode=verify-full "
            f"sslrootcert={carve_env.paths.tls_dir / 'ca.pem'}")
    with psycopg.connect(full, password=password, connect_timeout=10) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def guest_exec(env: CarveEnv, guest: Guest, argv: list[str], environment: list[str],
               timeout_s: float = 120) -> tuple[int, str, str]:
    """Run a command inside a guest through its QEMU guest agent: (exit code, stdout, stderr)."""
    conn = libvirt.open(env.config.host(guest.info.host).uri)
    try:
        dom = conn.lookupByName(guest.name)

        def agent(command: str, arguments: dict[str, Any]) -> Any:
            reply = libvirt_qemu.qemuAgentCommand(dom, json.dumps({"execute": command, "arguments": arguments}),
                                                  30, 0)
            return json.loads(reply)["return"]

        wait_for(lambda: _answers(agent), f"{guest.name}'s guest agent", 120)
        pid = agent("guest-exec", {"path": argv[0], "arg": argv[1:], "env": environment, "capture-output": True})["pid"]
        deadline = time.monotonic() + timeout_s
        while not (status := agent("guest-exec-status", {"pid": pid}))["exited"]:
            assert time.monotonic() < deadline, f"{argv[0]} in {guest.name} still runs after {timeout_s} s"
            time.sleep(0.5)
    finally:
        conn.close()

    def text(key: str) -> str:
        return base64.b64decode(status.get(key, "")).decode(errors="replace")

    return int(status.get("exitcode", -1)), text("out-data"), text("err-data")


def _answers(agent: Any) -> bool:
    try:
        agent("guest-ping", {})
        return True
    except libvirt.libvirtError:
        return False


def test_replication_is_accepted_only_from_the_instances_own_guests(carve_env: CarveEnv, fleet: Fleet) -> None:
    """Root on one instance's standby, with that instance's replication password, can replicate
    from its own primary and from no other instance's."""
    one, two = fleet.instance("pgc-01"), fleet.instance("pgc-02")
    assert one.primary is not None and two.primary is not None
    with fleet.connect(one.primary) as conn:
        allowed = sorted(hba.replication_addresses(conn))
    assert allowed == sorted(g.address for g in one.standbys if g.address), "exactly pgc-01's standbys"
    standby = one.standbys[0]
    password = fleet.instance_secrets("pgc-01").replication_password
    assert password != fleet.instance_secrets("pgc-02").replication_password

    def identify(primary: Guest) -> tuple[int, str, str]:
        conninfo = (f"host={primary.address} port=5432 user=replicator replication=true sslmode=verify-ca "
                    f"sslrootcert={GUEST_CA_FILE} connect_timeout=10")
        return guest_exec(carve_env, standby, ["/usr/bin/psql", "-X", "-At", "-c", "IDENTIFY_SYSTEM", conninfo],
                          [f"PGPASSWORD={password}", "HOME=/root"])

    code, out, err = identify(one.primary)
    assert code == 0 and out.strip(), (code, out, err)
    code, out, err = identify(two.primary)
    assert code != 0 and f'no pg_hba.conf entry for replication connection from host "{standby.address}"' in err, (
        code, out, err)
    print(f"from {standby.name} ({standby.address}) to pgc-02's primary: {err.strip().splitlines()[-1]}")


def test_the_command_line_connects(carve_env: CarveEnv, tmp_path: Path) -> None:
    """`pgcarve dsn`, `pgcarve connect` (psql on stdin) and `pgcarve service-file` +
    `psql service=NAME`, through the running API, as a user would type them."""
    env = dict(os.environ, PGCARVE_STATE_DIR=str(carve_env.paths.state_dir), PGCARVE_TOKEN=TOKEN, HOME=str(tmp_path))
    env.pop("PGPASSWORD", None)

    def pgcarve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "pgcarve.cli", *args], input=stdin, capture_output=True,
                              text=True, env=env, timeout=120, check=False)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    uris = endpoints(carve_env, "pgc-01")
    assert pgcarve("dsn", "pgc-01").stdout.strip() == uris["rw"]
    assert pgcarve("dsn", "pgc-01", "--ro").stdout.strip() == uris["ro"]
    with_password = conninfo_to_dict(pgcarve("dsn", "pgc-01", "--with-password").stdout.strip())
    assert with_password["password"] == credentials(carve_env, "pgc-01")["password"]

    query = "select current_user || ' ' || pg_is_in_recovery();\n"
    assert "app false" in pgcarve("connect", "pgc-01", stdin=query).stdout
    assert "app true" in pgcarve("connect", "pgc-01", "--ro", stdin=query).stdout

    exports = pgcarve("service-file", "--dir", str(tmp_path / "pg")).stdout.splitlines()
    variables = dict(line.removeprefix("export ").split("=", 1) for line in exports)
    assert set(variables) == {"PGSERVICEFILE", "PGPASSFILE"}
    assert (Path(variables["PGPASSFILE"]).stat().st_mode & 0o777) == 0o600
    for service, standby in (("pgc-01", "f"), ("pgc-01-ro", "t"), ("pgc-02", "f")):
        done = subprocess.run(["psql", "-X", "-At", "-c", "select current_user, pg_is_in_recovery()",
                               f"service={service}"], capture_output=True, text=True, timeout=60, check=False,
                              env={**env, **variables})
        assert done.returncode == 0 and done.stdout.strip() == f"app|{standby}", (service, done.stderr)


def test_purge_deletes_a_retired_instance_when_asked_by_name(carve_env: CarveEnv) -> None:
    """Last here: scaling to 1 retires pgc-02, and only `pgcarve purge NAME --confirm NAME` on a
    retired instance deletes its disks."""
    scale(carve_env, 1)
    # The operator's shell: the state directory and the API's token (purging is a mutation).
    env = dict(os.environ, PGCARVE_STATE_DIR=str(carve_env.paths.state_dir), PGCARVE_TOKEN=TOKEN)
    cli = [sys.executable, "-m", "pgcarve.cli"]
    status = subprocess.run([*cli, "status"], capture_output=True, text=True, env=env, check=True)
    assert "retired" in status.stdout and "pgcarve purge pgc-02" in status.stdout, status.stdout
    refused = subprocess.run([*cli, "purge", "pgc-02"], capture_output=True, text=True, env=env,
                             stdin=subprocess.DEVNULL)
    assert refused.returncode != 0 and "--confirm pgc-02" in refused.stderr + refused.stdout
    running = subprocess.run([*cli, "purge", "pgc-01", "--confirm", "pgc-01"], capture_output=True, text=True, env=env)
    assert running.returncode != 0 and "not retired" in running.stderr + running.stdout
    done = subprocess.run([*cli, "purge", "pgc-02", "--confirm", "pgc-02"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    print(done.stdout.strip())
    with carve_env.client() as client:
        assert [d["name"] for d in client.get("/v1/instances", params={"include": "retired"}).json()] == ["pgc-01"]
    fleet = Fleet(carve_env.config, carve_env.paths)
    assert not [v for v in leftovers(fleet) if "pgc-02" in v], "purged: pgc-02's disks are gone"
    fleet.close()
