"""The API's defences around the token and the network (issue 13):

* the Host header must name the server (the DNS-rebinding defence), refused with 421 naming the
  accepted names;
* "loopback" (reads open without the token) is decided from the bound socket;
* a short PGCARVE_TOKEN, or a token file others can read, stops the start, naming the fix;
* GET /v1/ca.pem serves the fleet CA;
* off loopback the server speaks HTTPS with a certificate from the fleet CA (or the operator's),
  server.json says so, and `pgcarve server start/stop` work with it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from fastapi.testclient import TestClient
from pgcarve import processes
from pgcarve.config import FleetConfig, HostConfig, Replication
from pgcarve.control.service import ManagerService
from pgcarve.errors import ConfigError
from pgcarve.guest.tls import FleetCA, certificate_names, issue_server_certificate, new_ca
from pgcarve.settings import Paths
from pgcarve.statedir.layout import make_fleet_secrets
from pgcarve_api.host_check import host_of
from pgcarve_api.https import server_tls
from pgcarve_api.listener import Listener, bind_listener, server_names
from pgcarve_api.main import create_app
from pgcarve_api.security import MIN_TOKEN_LENGTH
from pgcarve_api.settings import Settings

from tests.support.domains import reset_test_driver
from tests.support.localpg import free_ports

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hardening-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LOCAL = "http://127.0.0.1:8080"


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ManagerService]:
    monkeypatch.setenv("PGCARVE_IMAGE_DIR", str(tmp_path / "no-image"))
    keep_alive = reset_test_driver((1,))
    config = FleetConfig(hosts=[HostConfig(name="h1", uri="test:///default", role="primary")],
                         replication=Replication(standbys=0))
    make_fleet_secrets(Paths(tmp_path / "state"))  # as `serve` makes them for a new fleet
    service = ManagerService(config, Paths(tmp_path / "state"), refresh_s=0.2, collect=False, supervise=False)
    service.start()
    yield service
    service.stop()
    reset_test_driver().close()  # leave the shared driver empty (another module may keep it open)
    keep_alive.close()


def _settings(service: ManagerService, **changes: Any) -> Settings:
    return Settings(state_dir=service.paths.state_dir, **{"token": TOKEN, **changes})


# --- the Host header ------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1:8080", "127.0.0.1", "localhost", "LOCALHOST.:8080", "[::1]:8080",
                                  "[::1]"])
def test_loopback_names_are_accepted(fleet: ManagerService, host: str) -> None:
    with TestClient(create_app(_settings(fleet), service=fleet), base_url=LOCAL) as client:
        assert client.get("/v1/instances", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.test", "evil.test:8080", "127.0.0.1.evil.test", "localhost.evil.test",
                                  "127.0.0.2", "::1", "localhost:http", "[::1", "", "localhost@evil.test"])
def test_other_host_names_are_refused_with_the_accepted_ones(fleet: ManagerService, host: str) -> None:
    """Even on loopback, a Host that is not one of the server's names gets 421 and a detail that
    names them; a mutation with the right token changes nothing."""
    with TestClient(create_app(_settings(fleet), service=fleet), base_url=LOCAL) as client:
        resp = client.get("/v1/instances", headers={"Host": host})
        assert resp.status_code == 421, resp.text
        detail = resp.json()["detail"]
        assert "localhost, 127.0.0.1, ::1" in detail and "PGCARVE_ALLOWED_HOSTS" in detail
        put = client.put("/v1/scale", json={"instances": 2}, headers={**AUTH, "Host": host})
        assert put.status_code == 421
        assert client.get("/", headers={"Host": host}).status_code == 421, "the dashboard too"
    assert fleet.operations.all() == []


def test_allowed_hosts_extend_the_names(fleet: ManagerService) -> None:
    app = create_app(_settings(fleet, allowed_hosts="db-api.example, 192.0.2.7"), service=fleet)
    with TestClient(app, base_url=LOCAL) as client:
        for host in ("db-api.example", "DB-API.example:8080", "192.0.2.7:8080"):
            assert client.get("/healthz", headers={"Host": host}).status_code == 200, host
        assert client.get("/healthz", headers={"Host": "evil.test"}).status_code == 421


@pytest.mark.parametrize("bad", ["evil_test", "a/b", "-x.example", "http://x"])
def test_a_bad_allowed_host_stops_the_start(fleet: ManagerService, bad: str) -> None:
    with pytest.raises(ConfigError, match="PGCARVE_ALLOWED_HOSTS"):
        create_app(_settings(fleet, allowed_hosts=f"ok.example,{bad}"), service=fleet)


@pytest.mark.parametrize("header, host", [
    ("db1", "db1"), ("db1:8080", "db1"), ("[fd00::1]:8080", "fd00::1"), ("[::1]", "::1"),
    ("fd00::1", None), ("db1:", None), ("db1:x", None), ("[::1]x", None), ("", None),
])
def test_host_of(header: str, host: str | None) -> None:
    assert host_of(header) == host


def test_a_request_without_host_is_refused(fleet: ManagerService) -> None:
    """HTTP/1.0 without Host: refused, not guessed."""
    import asyncio

    app = create_app(_settings(fleet), service=fleet)
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/healthz", "raw_path": b"/healthz", "query_string": b"",
             "headers": [], "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5000), "scheme": "http",
             "http_version": "1.0", "root_path": "", "asgi": {"version": "3.0"}}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 421
    assert b"no Host header" in sent[1]["body"]


# --- loopback from the socket ---------------------------------------------------------------------

def test_binding_to_the_wildcard_address_is_off_loopback() -> None:
    """0.0.0.0 is off loopback whatever arrives over 127.0.0.1; a name counts for the address it
    resolved to (the socket is bound, never listened on: nothing can connect)."""
    sock, wildcard = bind_listener("0.0.0.0", 0)
    sock.close()
    assert (wildcard.address, wildcard.loopback, wildcard.wildcard) == ("0.0.0.0", False, True)
    sock, named = bind_listener("localhost", 0)
    sock.close()
    assert named.loopback and named.address == "127.0.0.1"
    assert Listener("db.example", "192.0.2.10", 8080).loopback is False
    assert Listener("127.0.0.5", "127.0.0.5", 8080).loopback is True


def test_a_loopback_name_on_a_non_loopback_socket_is_off_loopback(fleet: ManagerService) -> None:
    """bind=localhost, but the socket got 192.0.2.10 (say /etc/hosts maps it so): reads need
    the token. Bound to 127.0.0.1 through a host name, reads are open."""
    app = create_app(_settings(fleet, bind="localhost"), service=fleet,
                     listener=Listener("localhost", "192.0.2.10", 8080))
    with TestClient(app, base_url="http://localhost:8080") as client:
        assert client.get("/v1/instances").status_code == 401
        assert client.get("/v1/instances", headers=AUTH).status_code == 200
    app = create_app(_settings(fleet, bind="db-api.example"), service=fleet,
                     listener=Listener("db-api.example", "127.0.0.1", 8080))
    with TestClient(app, base_url="http://db-api.example:8080") as client:
        assert client.get("/v1/instances").status_code == 200


def test_server_names() -> None:
    names = server_names("0.0.0.0", Listener("0.0.0.0", "0.0.0.0", 8080), ["api.example"])
    assert {"localhost", "api.example", socket.gethostname().lower()} <= set(names.dns)
    assert {"127.0.0.1", "::1"} <= set(names.ips) and "0.0.0.0" not in names.ips
    specific = server_names("192.0.2.10", Listener("192.0.2.10", "192.0.2.10", 8080), [])
    assert specific.dns == () and specific.ips == ("192.0.2.10",), "off loopback, no localhost"


# --- the token ------------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["x" * (MIN_TOKEN_LENGTH - 1), "short"])
def test_a_short_token_stops_the_start(fleet: ManagerService, token: str) -> None:
    with pytest.raises(ConfigError) as err:
        create_app(_settings(fleet, token=token), service=fleet)
    assert f"at least {MIN_TOKEN_LENGTH}" in str(err.value) and "PGCARVE_TOKEN" in str(err.value)
    assert token not in str(err.value)
    create_app(_settings(fleet, token="x" * MIN_TOKEN_LENGTH), service=fleet)  # the minimum itself is fine


@pytest.mark.parametrize("token", ["token with spaces in it 0123456789", "tokén-0123456789abcdef0123456789"])
def test_a_token_that_cannot_be_sent_stops_the_start(fleet: ManagerService, token: str) -> None:
    with pytest.raises(ConfigError, match="printable ASCII"):
        create_app(_settings(fleet, token=token), service=fleet)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_token_file_others_can_read_stops_the_start(fleet: ManagerService, mode: int) -> None:
    token_file = fleet.paths.token_file
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text("f" * 43 + "\n")
    token_file.chmod(mode)
    with pytest.raises(ConfigError) as err:
        create_app(_settings(fleet, token=None), service=fleet)
    message = str(err.value)
    assert str(token_file) in message and f"{mode:04o}" in message and f"chmod 600 {token_file}" in message
    assert token_file.stat().st_mode & 0o777 == mode and token_file.read_text() == "f" * 43 + "\n"
    token_file.chmod(0o600)
    assert create_app(_settings(fleet, token=None), service=fleet).state.token == "f" * 43


# --- the fleet CA over the API --------------------------------------------------------------------

def test_ca_pem_is_the_fleet_ca(fleet: ManagerService) -> None:
    app = create_app(_settings(fleet), service=fleet)
    with TestClient(app, base_url=LOCAL) as client:
        resp = client.get("/v1/ca.pem")
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "application/x-pem-file"
        assert resp.content == (fleet.paths.tls_dir / "ca.pem").read_bytes()
        cert = x509.load_pem_x509_certificate(resp.content)
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert client.get("/v1/ca.pem").content == resp.content, "the same CA at every request"
    documented = app.openapi()["paths"]["/v1/ca.pem"]["get"]["responses"]["200"]["content"]
    assert list(documented) == ["application/x-pem-file"]


# --- which certificate the server serves -----------------------------------------------------------

def test_loopback_stays_plain_http(fleet: ManagerService) -> None:
    listener = Listener("127.0.0.1", "127.0.0.1", 8080)
    names = server_names("127.0.0.1", listener, [])
    assert server_tls(_settings(fleet), FleetCA(fleet.paths.tls_dir), listener, names) is None


def test_off_loopback_a_fleet_certificate_for_the_servers_names(fleet: ManagerService) -> None:
    listener = Listener("192.0.2.10", "192.0.2.10", 8080)
    names = server_names("192.0.2.10", listener, ["api.example"])
    fleet_ca = FleetCA(fleet.paths.tls_dir)
    tls = server_tls(_settings(fleet), fleet_ca, listener, names)
    assert tls is not None and tls.ca_file == fleet_ca.cert_file
    assert certificate_names(tls.cert_file.read_bytes()) == (["api.example"], ["192.0.2.10"])
    assert tls.key_file.stat().st_mode & 0o777 == 0o600
    x509.load_pem_x509_certificate(tls.cert_file.read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(fleet_ca.certificate_pem()))


def test_the_operators_certificate(fleet: ManagerService, tmp_path: Path) -> None:
    """Both files or neither; they must load as a pair; then they are served as given."""
    listener = Listener("192.0.2.10", "192.0.2.10", 8080)
    names = server_names("192.0.2.10", listener, [])
    fleet_ca = FleetCA(fleet.paths.tls_dir)
    own = issue_server_certificate(new_ca(), ["api.example"], [])
    cert, key = tmp_path / "own.pem", tmp_path / "own.key"
    cert.write_bytes(own.cert_pem)
    key.write_bytes(own.key_pem)
    tls = server_tls(_settings(fleet, tls_cert=cert, tls_key=key), fleet_ca, listener, names)
    assert tls is not None and (tls.cert_file, tls.key_file, tls.ca_file) == (cert, key, None)
    with pytest.raises(ConfigError, match="PGCARVE_TLS_CERT is set but PGCARVE_TLS_KEY is not"):
        server_tls(_settings(fleet, tls_cert=cert), fleet_ca, listener, names)
    with pytest.raises(ConfigError, match="PGCARVE_TLS_KEY is set but PGCARVE_TLS_CERT is not"):
        server_tls(_settings(fleet, tls_key=key), fleet_ca, listener, names)
    with pytest.raises(ConfigError, match="no such file"):
        server_tls(_settings(fleet, tls_cert=tmp_path / "missing.pem", tls_key=key), fleet_ca, listener, names)
    other_key = tmp_path / "other.key"
    other_key.write_bytes(issue_server_certificate(new_ca(), ["x.example"], []).key_pem)
    with pytest.raises(ConfigError, match="not a PEM certificate and its unencrypted private key"):
        server_tls(_settings(fleet, tls_cert=cert, tls_key=other_key), fleet_ca, listener, names)


# --- the real server, started as an operator does ---------------------------------------------------

def _server_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"replication": {"standbys": 0},
                                     "hosts": [{"name": "h1", "uri": "test:///default"}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGCARVE_")}
    env.update(PGCARVE_STATE_DIR=str(tmp_path / "state"), PGCARVE_HOSTS_FILE=str(hosts),
               PGCARVE_IMAGE_DIR=str(tmp_path / "no-image"), PGCARVE_COLLECT="0", PGCARVE_SUPERVISE="0",
               PGCARVE_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def _nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


# (A token file others can read no longer stops the start: it is made 0600 again and logged, as
# every secret file of the state directory is; test_state_check.py.)
@pytest.mark.parametrize("case", ["short-token", "half-tls"])
def test_a_refused_start_starts_nothing(tmp_path: Path, case: str) -> None:
    """`python -m pgcarve_api` (what `pgcarve serve` runs) exits with the reason and code 2;
    nothing listens and no server.json is written."""
    port = free_ports(1)[0]
    env = _server_env(tmp_path)
    if case == "short-token":
        env["PGCARVE_TOKEN"] = "too-short"
        expect = f"at least {MIN_TOKEN_LENGTH}"
    else:
        env["PGCARVE_TLS_CERT"] = str(tmp_path / "cert.pem")
        expect = "PGCARVE_TLS_CERT is set but PGCARVE_TLS_KEY is not"
    proc = subprocess.run([sys.executable, "-m", "pgcarve_api", "--port", str(port)], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "state" / "server.json").exists()
    assert _nothing_listens(port)


def test_server_start_reports_a_refused_start(tmp_path: Path) -> None:
    """`pgcarve server start` with a short token: the server's own reason, exit code 1, nothing left."""
    port = free_ports(1)[0]
    env = _server_env(tmp_path, PGCARVE_TOKEN="too-short")
    proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", "server", "start", "--port", str(port)], env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode != 0
    output = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
    assert "exited at start" in output and f"at least {MIN_TOKEN_LENGTH}" in output, output
    assert not (tmp_path / "state" / "server.json").exists() and _nothing_listens(port)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
                    reason="needs root, unshare and ip for a network namespace of its own")
def test_off_loopback_the_server_speaks_https_only(tmp_path: Path) -> None:
    """`pgcarve server start --bind 0.0.0.0` in a network namespace that has only `lo` (so the
    wildcard bind reaches no real interface): server.json says https and names the fleet CA;
    /healthz answers over TLS verified by that CA, for a certificate naming 127.0.0.1; reads
    need the token; Host: evil.test gets 421; plain HTTP and another CA get nowhere; `pgcarve
    server stop` stops it by its record."""
    port = 8443
    env = _server_env(tmp_path)
    proc = subprocess.run(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                           sys.executable, "-m", "tests.support.https_probe", str(port)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    left = processes.read_record(tmp_path / "state" / "server.json")[0]
    if left is not None:  # a failed probe must not leave its server behind
        processes.stop(left)
    assert "error" not in report, report
    assert report["start"]["code"] == 0, report["start"]
    server = report["server_json"]
    assert server["url"] == f"https://127.0.0.1:{port}"
    assert server["ca_file"] == str(tmp_path / "state" / "tls" / "ca.pem")
    assert {"pid", "start_time", "boot_id"} <= set(server)
    assert f"https://127.0.0.1:{port}/" in report["start"]["output"]
    assert report["healthz"] == 200
    assert report["anonymous_read"] == 401 and report["read_with_token"] == 200
    assert report["evil_host"]["status"] == 421 and "evil.test" in report["evil_host"]["detail"]
    assert report["ca_pem"] == {"status": 200, "type": "application/x-pem-file", "is_ca_file": True}
    assert {"127.0.0.1", "localhost"} <= set(report["peer_names"])
    assert report["plain_http"].startswith("refused"), report["plain_http"]
    assert report["other_ca"].startswith("refused") and "CERTIFICATE_VERIFY_FAILED" in report["other_ca"]
    assert report["stop"]["code"] == 0 and "stopped" in report["stop"]["output"]
    assert report["server_json_left"] is False


def test_server_stop_never_signals_a_stale_pid(tmp_path: Path) -> None:
    """server.json left by a server that is gone, its PID now another process's: `pgcarve
    server stop` says so, signals nothing, and removes the file."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        record = processes.record_process(other.pid)
        state = tmp_path / "state"
        processes.write_record(state / "server.json", record.__class__(record.pid, record.start_time - 1,
                                                                      record.boot_id), url="http://127.0.0.1:1")
        env = _server_env(tmp_path)
        proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", "server", "stop"], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "not signalled" in proc.stdout + proc.stderr and "another process" in proc.stdout + proc.stderr
        assert other.poll() is None
        assert not (state / "server.json").exists()
        legacy = {"pid": other.pid, "url": "http://127.0.0.1:1"}  # an older pgcarve's server.json
        (state / "server.json").write_text(json.dumps(legacy))
        proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", "server", "stop"], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert "without its start time" in proc.stdout + proc.stderr and other.poll() is None
    finally:
        other.kill()
        other.wait(5)
