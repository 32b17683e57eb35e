"""How applications connect, without guests: instance passwords in the state directory, the
libpq URIs (multi-host, TLS, no password), the API's endpoints and credentials, pg_hba's
replication rules, ports kept per guest name, and the `connect`, `dsn` and `service-file`
commands (psql replaced by a recorder)."""

from __future__ import annotations

import configparser
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from pgcarve import processes
from pgcarve.cli import connect_commands
from pgcarve.cli.client import ApiClient, ApiError
from pgcarve.cli.main import build_parser
from pgcarve.config import FleetConfig
from pgcarve.control.endpoints import application_uris, guest_names, instance_hosts
from pgcarve.control.fleet import Fleet, Guest, Instance
from pgcarve.control.service import ManagerService
from pgcarve.errors import ConfigError, NotFound
from pgcarve.guest.credentials import InstanceSecretStore
from pgcarve.postgres import conninfo, hba
from pgcarve.postgres.session import DEAD_SERVER_PARAMS, ClientTls
from pgcarve.sandbox.forward import Forward, ForwardRegistry
from pgcarve.settings import Paths, Settings
from psycopg.conninfo import conninfo_to_dict

from tests.support.api import app_for, service_on_test_driver

TOKEN = "unit-test-token-0123456789abcdef0123"
TLS = ClientTls("/var/lib/pgcarve/tls/ca.pem")
HOSTS = [("127.0.0.1", 41001), ("127.0.0.1", 41002), ("127.0.0.1", 41003)]
PASSWORD = "0123456789abcdef0123456789abcdef"


# --- instance passwords ----------------------------------------------------------------------

def test_instance_secrets_are_private_per_instance_and_go_with_the_instance(tmp_path: Path) -> None:
    store = InstanceSecretStore(tmp_path / "instances")
    one, two = store.load_or_create("pgc-01"), store.load_or_create("pgc-02")
    assert store.load_or_create("pgc-01") == one == store.load("pgc-01"), "made once, then kept"
    assert {one.app_password, one.replication_password}.isdisjoint({two.app_password, two.replication_password})
    assert one.app_password != one.replication_password
    assert stat.S_IMODE((tmp_path / "instances").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "instances" / "pgc-01.json").stat().st_mode) == 0o600
    store.remove("pgc-01")
    with pytest.raises(NotFound, match="no credentials recorded for instance pgc-01"):
        store.load("pgc-01")
    assert store.load_or_create("pgc-01") != one, "a new instance of the same name gets new passwords"
    with pytest.raises(ConfigError):
        store.load("../secrets")


# --- URIs ------------------------------------------------------------------------------------

def test_endpoint_uris_list_every_host_and_verify_the_server() -> None:
    uris = application_uris(HOSTS, TLS)
    assert uris.rw == ("postgresql://app@127.0.0.1:41001,127.0.0.1:41002,127.0.0.1:41003/app"
                       "?target_session_attrs=read-write&connect_timeout=10"
                       "&keepalives=1&keepalives_idle=10&keepalives_interval=5&keepalives_count=3&tcp_user_timeout=30000"
                       "&sslmode=verify-ca&sslrootcert=/var/lib/pgcarve/tls/ca.pem")
    parsed = conninfo_to_dict(uris.ro)  # what libpq itself reads from it
    assert parsed == {"user": "app", "host": "127.0.0.1,127.0.0.1,127.0.0.1", "port": "41001,41002,41003",
                      "dbname": "app", "target_session_attrs": "prefer-standby", "connect_timeout": "10",
                      **DEAD_SERVER_PARAMS, "sslmode": "verify-ca", "sslrootcert": "/var/lib/pgcarve/tls/ca.pem"}
    assert "password" not in conninfo_to_dict(uris.rw)


def test_uris_quote_what_needs_it() -> None:
    tls = ClientTls("/tmp/my ca/ca.pem", "verify-full")
    text = conninfo.uri("app", "app", [("fd00::7", 5432), ("10.77.1.2", 5432)], tls, password=PASSWORD)
    assert text.startswith(f"postgresql://app:{PASSWORD}@[fd00::7]:5432,10.77.1.2:5432/app?")
    parsed = conninfo_to_dict(text)
    assert parsed["host"] == "fd00::7,10.77.1.2" and parsed["sslrootcert"] == "/tmp/my ca/ca.pem"
    assert parsed["sslmode"] == "verify-full" and parsed["password"] == PASSWORD
    with pytest.raises(ConfigError):
        conninfo.uri("app", "app", [], tls)


def test_the_collectors_conninfo_verifies_the_server() -> None:
    parsed = conninfo_to_dict(conninfo.admin_conninfo("127.0.0.1", 41001, PASSWORD, TLS))
    assert parsed["sslmode"] == "verify-ca" and parsed["sslrootcert"] == TLS.root_cert
    assert parsed["user"] == "pgcarve" and parsed["dbname"] == "postgres"


@dataclass
class StubFleet:
    """What control/endpoints.py reads from a fleet."""

    config: FleetConfig
    forwards: ForwardRegistry


def _config(reach: str, standbys: int = 2, hosts: int = 3) -> FleetConfig:
    extra = {"reach": "sandbox", "netns": "ns"} if reach == "sandbox" else {}
    return FleetConfig.model_validate({
        "replication": {"standbys": standbys},
        "hosts": [{"name": f"h{i}", "uri": "test:///default", "role": "primary" if i == 0 else "standby", **extra}
                  for i in range(hosts)],
    })


def _guest(name: str, host: str, address: str | None) -> Guest:
    info = cast(Any, type("Info", (), {"name": name, "host": host}))
    return Guest(info=info, address=address, endpoint=None)


def test_sandbox_endpoints_keep_one_port_per_guest_name_for_good(tmp_path: Path) -> None:
    """The hosts of a sandbox instance are its guest names' forward ports, in a fixed order,
    whichever guest is primary and whether or not a guest exists right now."""
    fleet = cast(Fleet, StubFleet(_config("sandbox"), ForwardRegistry(tmp_path / "forwards")))
    assert guest_names(fleet, 1) == ["pgc-01", "pgc-01-s1", "pgc-01-s2"]
    whole = Instance(1, "pgc-01", _guest("pgc-01", "h0", "10.77.0.11"),
                     (_guest("pgc-01-s1", "h1", "10.77.1.11"), _guest("pgc-01-s2", "h2", "10.77.2.11")))
    failed_over = Instance(1, "pgc-01", _guest("pgc-01-s1", "h1", "10.77.1.11"),
                           (_guest("pgc-01-s2", "h2", "10.77.2.11"),))  # pgc-01 being rebuilt
    hosts = instance_hosts(fleet, whole)
    assert [h for h, _ in hosts] == ["127.0.0.1"] * 3 and len({p for _, p in hosts}) == 3
    assert instance_hosts(fleet, failed_over) == hosts
    again = cast(Fleet, StubFleet(_config("sandbox"), ForwardRegistry(tmp_path / "forwards")))
    assert instance_hosts(again, whole) == hosts, "another process reads the same ports"


def test_a_spare_standby_hosts_name_is_in_the_uris_before_a_member_is_built_there(tmp_path: Path) -> None:
    """With a standby host beyond the instance's two, a member of a lost host is built again there
    as pgc-01-s3 (control/recovery.py): the string applications hold already lists it."""
    fleet = cast(Fleet, StubFleet(_config("sandbox", hosts=4), ForwardRegistry(tmp_path / "forwards")))
    assert guest_names(fleet, 1) == ["pgc-01", "pgc-01-s1", "pgc-01-s2", "pgc-01-s3"]
    whole = Instance(1, "pgc-01", _guest("pgc-01", "h0", None),
                     (_guest("pgc-01-s1", "h1", None), _guest("pgc-01-s2", "h2", None)))
    moved = Instance(1, "pgc-01", _guest("pgc-01", "h0", None),
                     (_guest("pgc-01-s3", "h3", None), _guest("pgc-01-s2", "h2", None)))
    assert instance_hosts(fleet, moved) == instance_hosts(fleet, whole)
    assert len(instance_hosts(fleet, whole)) == 4


def test_direct_endpoints_list_the_guests_addresses(tmp_path: Path) -> None:
    fleet = cast(Fleet, StubFleet(_config("direct"), ForwardRegistry(tmp_path / "forwards")))
    inst = Instance(1, "pgc-01", _guest("pgc-01", "h0", "10.77.0.11"),
                    (_guest("pgc-01-s1", "h1", None), _guest("pgc-01-s2", "h2", "10.77.2.11")))
    assert instance_hosts(fleet, inst) == [("10.77.0.11", 5432), ("10.77.2.11", 5432)]


# --- ports per guest name ----------------------------------------------------------------------

def test_a_guest_name_keeps_its_port_until_the_sandbox_goes(tmp_path: Path) -> None:
    registry = ForwardRegistry(tmp_path / "forwards")
    first = registry.port("pgc-01")
    assert registry.port("pgc-01") == first and registry.port("pgc-01-s1") != first
    registry.remove("pgc-01")  # the guest's forward stops (guest removed): its port stays its own
    assert ForwardRegistry(tmp_path / "forwards").port("pgc-01") == first
    moved = registry._assign("pgc-01", avoid=first)  # the port was taken by another program
    assert moved != first and registry.port("pgc-01") == moved
    registry.remove_all()
    assert registry.ports() == {} and not (tmp_path / "forwards" / "ports.json").exists()


# --- pg_hba's replication rules ------------------------------------------------------------------

def test_replication_rules_replace_only_replication_rules() -> None:
    base = ("# header\nlocal all postgres peer\nhostssl all pgcarve 10.77.0.0/16 scram-sha-256\n"
            "hostssl replication replicator 10.77.9.9/32 scram-sha-256\n"
            "hostssl postgres replicator 10.77.9.9/32 scram-sha-256\n\n")
    lines = hba.with_standbys(base, ["10.77.2.4", "10.77.1.3", "10.77.2.4", "fd00::1"])
    # Per address: streaming, and database postgres for pg_rewind (a former primary rejoining).
    assert lines == ["# header", "local all postgres peer", "hostssl all pgcarve 10.77.0.0/16 scram-sha-256",
                     "hostssl replication replicator 10.77.1.3/32 scram-sha-256",
                     "hostssl postgres replicator 10.77.1.3/32 scram-sha-256",
                     "hostssl replication replicator 10.77.2.4/32 scram-sha-256",
                     "hostssl postgres replicator 10.77.2.4/32 scram-sha-256",
                     "hostssl replication replicator fd00::1/128 scram-sha-256",
                     "hostssl postgres replicator fd00::1/128 scram-sha-256"]
    assert hba.with_standbys("\n".join(lines), []) == lines[:3]


@pytest.mark.parametrize("address", ["10.77.0.0/16", "all", "10.77.1.3 trust", "fe80::1%eth0", ""])
def test_replication_rules_take_plain_addresses_only(address: str) -> None:
    with pytest.raises(ConfigError):
        hba.with_standbys("", [address])


# --- the API -------------------------------------------------------------------------------------

@pytest.fixture
def sandbox_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, ManagerService]]:
    """Two instances on hosts reached like sandbox hosts. The test driver hands out addresses of
    the real network (192.168.122.x): no forward may start towards them, so `ensure` only names
    the port a forward would have."""

    def no_forward(registry: ForwardRegistry, name: str, netns: str, target: str) -> Forward:
        return Forward(processes.record_self(), registry.port(name), target, netns)

    monkeypatch.setattr(ForwardRegistry, "ensure", no_forward)
    with (service_on_test_driver(tmp_path, instances=2, sandbox=True) as service,
          TestClient(app_for(service, token=TOKEN), base_url="http://127.0.0.1:8080") as client):
        yield client, service


def test_instances_have_endpoints_and_credentials_need_the_token(
    sandbox_api: tuple[TestClient, ManagerService],
) -> None:
    client, service = sandbox_api
    docs = client.get("/v1/instances").json()
    port = service.fleet.forwards.port("pgc-01")
    rw = docs[0]["endpoints"]["rw"]
    assert rw.startswith(f"postgresql://app@127.0.0.1:{port}/app?target_session_attrs=read-write")
    assert f"sslrootcert={service.paths.tls_dir / 'ca.pem'}" in rw and "sslmode=verify-ca" in rw
    assert client.get("/v1/instances/pgc-01").json()["endpoints"] == docs[0]["endpoints"]
    assert docs[1]["endpoints"]["ro"].count("prefer-standby") == 1
    # The credentials are a secret: the token is needed on loopback too, where other reads are open.
    assert client.get("/v1/instances/pgc-01/credentials").status_code == 401
    resp = client.get("/v1/instances/pgc-01/credentials", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200 and resp.headers["cache-control"] == "no-store"
    secrets = service.fleet.instance_secrets("pgc-01")
    assert resp.json() == {"user": "app", "password": secrets.app_password, "database": "app"}
    other = client.get("/v1/instances/pgc-02/credentials", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert other["password"] != secrets.app_password
    assert client.get("/v1/instances/pgc-09/credentials",
                      headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    schema = client.get("/openapi.json").json()
    assert "/v1/instances/{name}/credentials" in schema["paths"]
    assert set(schema["components"]["schemas"]["EndpointsOut"]["properties"]) == {"rw", "ro"}


# --- the command line ------------------------------------------------------------------------------

@dataclass
class FakeApi:
    """An ApiClient stand-in: two instances, one without credentials."""

    ca_pem: str
    endpoints: dict[str, dict[str, str]]
    calls: list[str] = field(default_factory=list)
    url: str = "http://127.0.0.1:8080"

    def get(self, path: str, **_params: Any) -> Any:
        self.calls.append(path)
        return [{"name": n, "endpoints": e} for n, e in self.endpoints.items()]

    def get_text(self, path: str, **_params: Any) -> str:
        self.calls.append(path)
        return self.ca_pem

    def instance(self, name: str) -> dict[str, Any]:
        self.calls.append(f"instance {name}")
        return {"name": name, "endpoints": self.endpoints[name]}

    def credentials(self, name: str) -> dict[str, str]:
        self.calls.append(f"credentials {name}")
        if name == "pgc-02":
            raise ApiError(404, "no credentials recorded for instance pgc-02")
        return {"user": "app", "password": PASSWORD, "database": "app"}


@pytest.fixture
def fake_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    server_ca = tmp_path / "server" / "ca.pem"
    server_ca.parent.mkdir()
    server_ca.write_text("-----BEGIN CERTIFICATE-----\nfleet\n-----END CERTIFICATE-----\n")
    tls = ClientTls(str(server_ca))
    api = FakeApi(server_ca.read_text(), {"pgc-01": application_uris(HOSTS, tls).__dict__,
                                          "pgc-02": application_uris([("127.0.0.1", 41004)], tls).__dict__})
    monkeypatch.setattr(ApiClient, "for_settings", classmethod(lambda _cls, _settings, _url=None: api))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return api


def _run(argv: list[str], settings: Settings) -> int:
    args = build_parser(settings).parse_args(argv)
    return int(args.func(args, settings))


def test_the_commands_parse_their_arguments() -> None:
    parser = build_parser(Settings())
    args = parser.parse_args(["connect", "pgc-01", "--ro"])
    assert (args.func, args.name, args.ro, args.url) == (connect_commands.cmd_connect, "pgc-01", True, None)
    args = parser.parse_args(["dsn", "pgc-02", "--with-password", "--url", "https://db1:8080"])
    assert (args.name, args.ro, args.with_password, args.url) == ("pgc-02", False, True, "https://db1:8080")
    assert parser.parse_args(["service-file", "--dir", "/tmp/x"]).dir == "/tmp/x"
    with pytest.raises(SystemExit):
        parser.parse_args(["connect"])  # the instance is required


def test_connect_execs_psql_with_the_password_in_its_environment_only(
    fake_api: FakeApi, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    seen: dict[str, Any] = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        seen.update(path=path, argv=argv, env=env)

    monkeypatch.setattr(connect_commands.os, "execve", execve)
    monkeypatch.setattr(connect_commands.shutil, "which", lambda _name: "/usr/bin/psql")
    assert _run(["connect", "pgc-01"], Settings(state_dir=tmp_path / "state")) == 0
    assert seen["argv"][0] == "/usr/bin/psql" and len(seen["argv"]) == 2
    assert all(PASSWORD not in arg for arg in seen["argv"])
    assert seen["env"]["PGPASSWORD"] == PASSWORD and "PGPASSWORD" not in os.environ
    parsed = conninfo_to_dict(seen["argv"][1])
    assert parsed["target_session_attrs"] == "read-write" and parsed["sslmode"] == "verify-ca"
    assert parsed["sslrootcert"] == str(tmp_path / "server" / "ca.pem"), "the API's own CA file, here"
    _run(["connect", "pgc-01", "--ro"], Settings(state_dir=tmp_path / "state"))
    assert conninfo_to_dict(seen["argv"][1])["target_session_attrs"] == "prefer-standby"


def test_dsn_prints_the_uri_and_the_password_only_when_asked(
    fake_api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings(state_dir=tmp_path / "state")
    _run(["dsn", "pgc-01"], settings)
    plain = capsys.readouterr().out.strip()
    assert plain == fake_api.endpoints["pgc-01"]["rw"] and "credentials pgc-01" not in fake_api.calls
    _run(["dsn", "pgc-01", "--ro", "--with-password"], settings)
    full = conninfo_to_dict(capsys.readouterr().out.strip())
    assert full["password"] == PASSWORD and full["target_session_attrs"] == "prefer-standby"


def test_dsn_elsewhere_uses_a_local_copy_of_the_ca(fake_api: FakeApi, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """On a machine without the API's CA file, the CA from GET /v1/ca.pem is saved under ~/.pgcarve."""
    (tmp_path / "server" / "ca.pem").unlink()
    _run(["dsn", "pgc-01"], Settings(state_dir=tmp_path / "state"))
    copy = Path(str(conninfo_to_dict(capsys.readouterr().out.strip())["sslrootcert"]))
    assert copy.parent == tmp_path / "home" / ".pgcarve" and copy.read_text() == fake_api.ca_pem


def test_service_file_names_every_instance_for_libpq(
    fake_api: FakeApi, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out_dir = tmp_path / "conf"
    assert _run(["service-file", "--dir", str(out_dir)], Settings(state_dir=tmp_path / "state")) == 0
    exports = capsys.readouterr().out.splitlines()
    assert exports == [f"export PGSERVICEFILE={out_dir / 'pg_service.conf'}",
                       f"export PGPASSFILE={out_dir / '.pgpass'}"]
    services = configparser.ConfigParser()
    services.read(out_dir / "pg_service.conf")
    assert services.sections() == ["pgc-01", "pgc-01-ro"], "pgc-02 has no credentials: left out"
    assert dict(services["pgc-01"]) == {
        "host": "127.0.0.1,127.0.0.1,127.0.0.1", "port": "41001,41002,41003", "dbname": "app", "user": "app",
        "target_session_attrs": "read-write", "connect_timeout": "10", **DEAD_SERVER_PARAMS, "sslmode": "verify-ca",
        "sslrootcert": str(out_dir / "ca.pem")}
    assert services["pgc-01-ro"]["target_session_attrs"] == "prefer-standby"
    assert (out_dir / ".pgpass").read_text().splitlines() == [f"127.0.0.1:{p}:app:app:{PASSWORD}" for _, p in HOSTS]
    assert stat.S_IMODE((out_dir / ".pgpass").stat().st_mode) == 0o600
    assert (out_dir / "ca.pem").read_text() == fake_api.ca_pem
    assert PASSWORD not in (out_dir / "pg_service.conf").read_text()


def test_pgpass_fields_are_escaped() -> None:
    endpoint = connect_commands.Endpoint("a:b", "d\\b", (("fd00::1", 5432),), {}, "verify-ca")
    assert endpoint.pgpass_lines("pw") == ["fd00\\:\\:1:5432:d\\\\b:a\\:b:pw"]


def test_no_api_is_a_clear_error(tmp_path: Path) -> None:
    client = ApiClient("http://127.0.0.1:9", timeout_s=2)
    with pytest.raises(ApiError, match=r"no pgcarve API answers at http://127\.0\.0\.1:9"):
        client.instance("pgc-01")


def test_paths_keep_instance_secrets_in_the_state_directory(tmp_path: Path) -> None:
    assert Paths(tmp_path).instance_secrets_dir == tmp_path / "instances"
