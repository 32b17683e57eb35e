"""Security properties, end to end but without guests:

* bad hosts-file values are refused, naming the field, before they can reach XML, a shell or SQL;
* the domain XML is built by escaping, never by pasting strings;
* the seed carries SCRAM verifiers (the admin password never leaves the manager), and the guest
  script re-validates the seed, writes a TLS-only, scram-only pg_hba limited to the seed's
  networks (replication: to the instance's own guests' addresses) and quotes SQL literals;
* the API token guards every mutation (and every read when bound off loopback), is compared in
  constant time, is stored 0600 and never appears in logs or page source; oversized bodies are
  refused before they change anything.

"""

from __future__ import annotations

import base64
import importlib
import json
import logging
import os
import pkgutil
import re
import secrets
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pgcarve.config import FleetConfig, load_fleet_config
from pgcarve.control.service import ManagerService
from pgcarve.errors import ConfigError
from pgcarve.guest import seed as guest_config
from pgcarve.guest.credentials import new_secret
from pgcarve.guest.seed import GuestSeed
from pgcarve.virt.domain_xml import Disk, DomainSpec, InstanceMetadata, Nic, mac_for
from pgcarve_api import routes as routes_package
from pgcarve_api import security
from pgcarve_api.advice_runs import AdviceStore
from pgcarve_api.listener import Listener
from pgcarve_api.main import create_app
from pgcarve_api.routes.dashboard import STATIC_DIR
from pgcarve_api.settings import Settings
from pydantic import ValidationError

from tests.support.api import app_for, read_stream_start, service_on_test_driver
from tests.support.seeds import CIDRS, CREDS, SECRETS, guest_seed

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "security-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LOCAL = "http://127.0.0.1:8080"  # what a client on loopback sends as Host (TestClient's default is refused)
SCRAM_FORMAT = re.compile(r"^SCRAM-SHA-256\$(\d+):([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+):([A-Za-z0-9+/=]+)$")

# Characters that would break out of XML, a shell command line, SQL or a path.
HOSTILE_NAMES = ["a<b", "a'b", 'a"b', "a;b", "a$(id)", "a b", "a\nb", "a\n", "../etc", "a&b"]
# ipaddress accepts IPv6 scope ids ("fe80::%<anything but %>"): spaces and newlines included.
SCOPE_CIDR = "fe80::%lo ffff:: trust\nhost all all 0.0.0.0 0.0.0.0 trust\n#/64"


# --- 1. the hosts file -----------------------------------------------------------------------

def _hosts_doc(**host: str) -> dict[str, object]:
    return {"replication": {"standbys": 0},
            "hosts": [{"name": "h1", "uri": "qemu:///system", **host}]}


def _refused(tmp_path: Path, doc: dict[str, object], field: str) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}: .*{re.escape(field)}: "):
        load_fleet_config(path)


def test_a_plain_hosts_file_loads(tmp_path: Path) -> None:
    """Positive control for the refusals below: the base document itself is valid."""
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"fleet": "pgc", **_hosts_doc(pool="pool_1.a", network="net-1")}))
    assert load_fleet_config(path).hosts[0].pool == "pool_1.a"


@pytest.mark.parametrize("value", HOSTILE_NAMES)
@pytest.mark.parametrize("field", ["fleet", "hosts.0.name", "hosts.0.pool", "hosts.0.network"])
def test_hostile_names_in_the_hosts_file_are_refused(tmp_path: Path, field: str, value: str) -> None:
    """Names that end up in domain XML, volume paths or commands accept no markup, quotes,
    shell syntax, whitespace, newlines or path traversal; the error names the field."""
    doc = {"fleet": value, **_hosts_doc()} if field == "fleet" else _hosts_doc(**{field.split(".")[-1]: value})
    _refused(tmp_path, doc, field)


@pytest.mark.parametrize("uri", [
    "qemu:///system\n",
    "qemu+ssh://root@db1/system\nProxyCommand=sh",
    "qemu+ssh://root@db1/system'; rm -rf /",
    "$(id)://x",
    "qemu:/system",
])
def test_malformed_libvirt_uris_are_refused(tmp_path: Path, uri: str) -> None:
    """A libvirt URI is a URI: no newlines, whitespace or quotes after the scheme either."""
    _refused(tmp_path, _hosts_doc(uri=uri), "hosts.0.uri")


def test_netns_cannot_traverse_paths(tmp_path: Path) -> None:
    """The sandbox netns name becomes /run/netns/<name>: no '../'."""
    _refused(tmp_path, _hosts_doc(reach="sandbox", netns="../../proc/1/ns/net"), "hosts.0.netns")


@pytest.mark.parametrize("cidr", [
    "10.0.0.0/8 trust",
    "not-a-network",
    SCOPE_CIDR,
])
def test_allowed_cidrs_must_be_networks(tmp_path: Path, cidr: str) -> None:
    """allowed_cidrs end up in every guest's pg_hba.conf: only real networks are accepted."""
    _refused(tmp_path, {**_hosts_doc(), "allowed_cidrs": [cidr]}, "allowed_cidrs")


# --- 2. domain XML ---------------------------------------------------------------------------

XML_HOSTILE = "&<>\"' ]]> <!-- x --> $(id); `x` \\ \n"


def _spec(**changes: Any) -> DomainSpec:
    fields: dict[str, Any] = dict(
        name="pgc-01", domain_type="qemu",
        metadata=InstanceMetadata(fleet="pgc", cluster="pgc-01", role="primary", index=1),
        memory_mib=1024, vcpu_pins=(2,), emulator_cpus=(0,), kernel="/k", initrd="/i",
        disks=(Disk("vda", "default", "pgc-01.qcow2"),), nics=(Nic("default", mac_for("pgc", "pgc-01")),),
    )
    fields.update(changes)
    return DomainSpec(**fields)


def test_free_text_fields_round_trip_through_the_domain_xml() -> None:
    """Every field that permits arbitrary text is escaped (text and attributes), so the XML parses
    back to exactly the given values and no extra element appears."""
    values = {field: f"/{field}/{XML_HOSTILE}" for field in ("title", "kernel", "initrd", "cmdline",
                                                             "console_log", "machine")}
    spec = _spec(**values)
    root = ET.fromstring(spec.to_xml())
    assert root.findtext("title") == values["title"]
    assert root.findtext("os/kernel") == values["kernel"]
    assert root.findtext("os/initrd") == values["initrd"]
    assert root.findtext("os/cmdline") == values["cmdline"]
    os_type = root.find("os/type")
    assert os_type is not None and os_type.attrib["machine"] == values["machine"]
    log_el = root.find("devices/serial/log")
    assert log_el is not None and log_el.attrib["file"] == values["console_log"]
    assert InstanceMetadata.from_domain_xml(spec.to_xml()) == spec.metadata
    assert [child.tag for child in root] == [child.tag for child in ET.fromstring(_spec().to_xml())]


@pytest.mark.parametrize(
    "value", HOSTILE_NAMES)
def test_identifiers_in_the_domain_xml_cannot_carry_markup(value: str) -> None:
    """Names, networks, pools and volumes reach libvirt as identifiers: the constructors refuse
    anything outside their character sets."""
    attempts = [
        lambda: _spec(name=value),
        lambda: InstanceMetadata(fleet=value, cluster="pgc-01", role="primary", index=1),
        lambda: InstanceMetadata(fleet="pgc", cluster=value, role="primary", index=1),
        lambda: _spec(nics=(Nic(value, mac_for("pgc", "pgc-01")),)),
        lambda: _spec(disks=(Disk("vda", value, "v.qcow2"),)),
        lambda: _spec(disks=(Disk("vda", "default", value),)),
    ]
    for attempt in attempts:
        with pytest.raises(ConfigError):
            attempt()


# --- 3. the guest-side setup script ----------------------------------------------------------



def _standby_seed() -> dict[str, object]:
    seed = guest_seed("pgc-01-s1", "standby", primary_host="10.77.0.12",
                      synchronous_standby_names="FIRST 1 (pgc_01_s1, pgc_01_s2)")
    return seed.instance_json()


def _load(guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          doc: dict[str, object]) -> dict[str, object]:
    path = tmp_path / "instance.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setattr(guest_setup, "SEED", path)
    loaded: dict[str, object] = guest_setup.load_seed_file()
    return loaded


STANDBY_ADDRESSES = ["10.77.1.23", "10.77.2.40"]


@pytest.mark.parametrize("role", ["primary", "standby"])
def test_pg_hba_is_tls_and_scram_only_and_limited_to_the_seed_networks(
    guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str,
) -> None:
    """The manager's seed passes the guest's validation, and the pg_hba written from it has only
    hostssl scram-sha-256 network lines (no `host` line, no trust/md5/password), for the admin
    role (any database), the application role (its own database only) and the replication role
    (replication only, from the instance's other guests' addresses only), and no network beyond
    the seed's CIDRs and loopback."""
    doc = _standby_seed() if role == "standby" else guest_seed("pgc-01", "primary").instance_json()
    hba = guest_setup.pg_hba(_load(guest_setup, tmp_path, monkeypatch, doc), STANDBY_ADDRESSES)
    rules = [line.split() for line in hba.splitlines() if line.strip() and not line.startswith("#")]
    assert not re.search(r"\b(trust|md5|password|ident|cert)\b", hba)
    host_rules = [r for r in rules if r[0] != "local"]
    assert all(r[0] == "hostssl" and len(r) == 5 and r[4] == "scram-sha-256" for r in host_rules), hba
    assert all(r[2] == "replicator" for r in host_rules if r[1] == "replication")
    # replicator: replication, and the postgres database for pg_rewind (a former primary rejoining
    # reads files through grants on pg_ls_dir/pg_stat_file/pg_read_binary_file only).
    assert all(r[1] in ("replication", "postgres") for r in host_rules if r[2] == "replicator")
    assert {r[2] for r in host_rules} == {"pgcarve", "app", "replicator"}, "no network login for postgres or all"
    assert {r[1] for r in host_rules if r[2] == "app"} == {"app"}, "the application role reaches its database only"
    assert {r[3] for r in host_rules if r[2] != "replicator"} == {*CIDRS, "127.0.0.1/32"}
    for database in ("replication", "postgres"):
        assert [r[3] for r in host_rules if r[2] == "replicator" and r[1] == database] == \
            [f"{a}/32" for a in STANDBY_ADDRESSES]
    assert all(r[-1] in ("peer", "map=pgcarve") for r in rules if r[0] == "local")


def test_guest_and_manager_write_the_same_replication_rules(
    guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The manager rewrites pg_hba.conf's replication rules at run time (postgres/hba.py) and the
    guest composes them at boot from the list the manager wrote beside it: the same file either way."""
    from pgcarve.postgres import hba

    seed = _load(guest_setup, tmp_path, monkeypatch, guest_seed("pgc-01", "primary").instance_json())
    at_boot = guest_setup.pg_hba(seed, ["10.77.2.40", "10.77.1.23"])
    rewritten = hba.with_standbys(guest_setup.pg_hba(seed, ["10.77.9.9"]), ["10.77.2.40", "10.77.1.23", "10.77.1.23"])
    assert "\n".join(rewritten) + "\n" == guest_setup.pg_hba(seed, STANDBY_ADDRESSES)
    assert sorted(at_boot.splitlines()) == sorted(rewritten)
    assert [guest_setup.replication_rules(a) for a in STANDBY_ADDRESSES] == \
        [hba.replication_rules(a) for a in STANDBY_ADDRESSES]


def test_the_guest_reads_only_addresses_from_the_standbys_file(guest_setup: ModuleType, tmp_path: Path) -> None:
    """What the manager wrote beside pg_hba.conf reaches pg_hba only as validated addresses."""
    listed = tmp_path / "pgcarve-standbys"
    listed.write_text("10.77.2.40\n10.77.1.23\n\n10.0.0.0/8 trust\nall\nfe80::1%x host\n10.77.1.23\n")
    assert guest_setup.standby_addresses(listed) == ["10.77.1.23", "10.77.2.40"]
    assert guest_setup.standby_addresses(tmp_path / "missing") == []


def test_the_standby_streams_with_the_managers_conninfo(guest_setup: ModuleType) -> None:
    """A standby's first clone (guest) and a later `follow` (manager) use one conninfo: TLS
    verified with the fleet CA the seed put in the guest."""
    from pgcarve.postgres.conninfo import standby_conninfo

    doc = _standby_seed()
    manager = standby_conninfo(str(doc["primary_host"]), "pgc-01-s1", SECRETS.replication_password)
    assert manager == guest_setup.standby_conninfo(doc) + f" password={SECRETS.replication_password}"
    assert "sslmode=verify-ca" in manager and f"sslrootcert={guest_setup.TLS_CA}" in manager


def test_the_manager_seed_passes_the_guest_checks(
    guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Positive control for the refusals below: the unmodified standby seed loads."""
    loaded = _load(guest_setup, tmp_path, monkeypatch, _standby_seed())
    assert loaded["slot_name"] == "pgcarve_pgc_01_s1" and loaded["allowed_cidrs"] == list(CIDRS)


@pytest.mark.parametrize("key, value", [
    ("name", "pgc-01'; DROP ROLE pgcarve; --"),
    ("name", "PGC 01"),
    ("role", "superuser"),
    ("admin_password_scram", "md5" + "0" * 32),
    ("admin_password_scram", "plain-password"),
    ("admin_password_scram", "SCRAM-SHA-256$4096:c2FsdA==$a2V5:a2V5'; ALTER ROLE postgres PASSWORD 'x"),
    ("replication_password_scram", "SCRAM-SHA-256$4096:c2FsdA==$a2V5"),
    ("synchronous_standby_names", "FIRST 1 (a'); x"),
    ("synchronous_standby_names", "FIRST 1 (a); SELECT 1"),
    ("synchronous_standby_names", "FIRST 1 (a)\nfsync = off"),
    ("synchronous_commit", "on'\nfsync = off\n#"),
    ("primary_host", "db1.example.com"),
    ("primary_host", "10.77.0.12 host=10.6.6.6"),
    ("primary_host", ""),
    ("replication_password", "pw' host=10.6.6.6 x='" + "a" * 16),
    ("slot_name", "slot'; DROP TABLE x; --"),
    ("slot_name", "slot name"),
    ("slot_name", "Slot"),
    ("allowed_cidrs", ["10.0.0.0/8 trust"]),
    ("allowed_cidrs", ["all"]),
    ("primary_host", "fe80::1%x host=10.6.6.6 user=postgres"),
    ("allowed_cidrs", [SCOPE_CIDR]),
    ("slot_name", "pgcarve_pgc_01_s1\n"),
])
def test_the_guest_refuses_malformed_seeds(
    guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: object,
) -> None:
    """The guest re-validates every seed value that reaches pg_hba, postgresql.conf, a conninfo
    string or SQL, whatever the manager sent."""
    doc = {**_standby_seed(), key: value}
    with pytest.raises((SystemExit, ValueError)):
        _load(guest_setup, tmp_path, monkeypatch, doc)


def test_no_hosts_file_network_can_inject_a_trust_rule(
    guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end: an allowed_cidrs entry travels hosts file -> GuestSeed -> guest validation ->
    pg_hba.conf; it must be refused somewhere, or at least never yield a 'trust' rule."""
    try:
        config = FleetConfig.model_validate({**_hosts_doc(), "allowed_cidrs": [SCOPE_CIDR]})
        seed = guest_seed("pgc-01", "primary", tuple(config.allowed_cidrs))
        hba = guest_setup.pg_hba(_load(guest_setup, tmp_path, monkeypatch, seed.instance_json()))
    except (ConfigError, ValidationError, SystemExit, ValueError):
        return
    assert "trust" not in hba, hba


@pytest.mark.parametrize("value", ["it's", "'; DROP ROLE pgcarve; --", "''", "plain", ""])
def test_quote_literal_doubles_single_quotes(guest_setup: ModuleType, value: str) -> None:
    """quote_literal yields one SQL string literal that decodes back to the value: every inner
    quote is doubled, so no quote can end the literal early."""
    quoted = guest_setup.quote_literal(value)
    assert quoted.startswith("'") and quoted.endswith("'")
    inner = quoted[1:-1]
    assert re.fullmatch(r"(?:[^']|'')*", inner), quoted
    assert inner.replace("''", "'") == value


# --- 4. what the seed carries ----------------------------------------------------------------

def _seeds() -> list[GuestSeed]:
    return [guest_seed("pgc-01", "primary", synchronous_standby_names="FIRST 1 (pgc_01_s1)"),
            guest_seed("pgc-01-s1", "standby", primary_host="10.77.0.12")]


@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: s.role)
def test_seed_verifiers_are_scram_sha_256(guest_setup: ModuleType, seed: GuestSeed) -> None:
    """Both roles get SCRAM-SHA-256 verifiers (iterations, 16-byte salt, 32-byte keys), salted
    afresh for every seed, in the exact shape the guest script accepts."""
    first, second = seed.instance_json(), seed.instance_json()
    keys = ["admin_password_scram", "replication_password_scram"]
    for key in keys + (["app_password_scram"] if seed.role == "primary" else []):
        match = SCRAM_FORMAT.match(str(first[key]))
        assert match and guest_setup.SCRAM_RE.match(first[key]), first[key]
        iterations, salt, stored, server = match.groups()
        assert int(iterations) >= 4096
        assert len(base64.b64decode(salt)) == 16
        assert len(base64.b64decode(stored)) == len(base64.b64decode(server)) == 32
        assert first[key] != second[key], "a fresh salt per seed"


@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: s.role)
def test_the_admin_password_never_leaves_the_manager(seed: GuestSeed) -> None:
    """No seed (user-data or meta-data) carries the admin or the application password; the
    replication password appears in plain text only in a standby's seed, once, as the login it needs."""
    text = seed.user_data() + seed.meta_data("iid-1")
    assert CREDS.admin_password not in text and SECRETS.app_password not in text
    instance = seed.instance_json()
    carrying = [k for k, v in instance.items() if v == SECRETS.replication_password]
    if seed.role == "standby":
        assert carrying == ["replication_password"]
        assert text.count(SECRETS.replication_password) == 1
    else:
        assert carrying == [] and SECRETS.replication_password not in text
    config = json.loads(seed.user_data().split("\n", 1)[1])
    assert [f["permissions"] for f in config["write_files"]] == ["0600"]


def test_seed_iso_user_data_is_private_and_passwords_stay_off_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """write_seed_iso makes user-data 0600 before genisoimage reads it, and no password is
    passed as an argument (argv is visible to every local user)."""
    seen: dict[str, object] = {}

    def fake_run(argv: list[str], **_kwargs: object) -> subprocess.CompletedProcess[str]:
        user_data = next(Path(a.removeprefix("user-data=")) for a in argv if a.startswith("user-data="))
        seen["mode"] = user_data.stat().st_mode & 0o777
        seen["argv"] = " ".join(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(guest_config.shutil, "which", lambda _name: "/usr/bin/genisoimage")
    monkeypatch.setattr(guest_config.subprocess, "run", fake_run)
    guest_config.write_seed_iso(_seeds()[1], "iid-1", tmp_path / "seed.iso")
    assert seen["mode"] == 0o600
    assert CREDS.admin_password not in str(seen["argv"])
    assert SECRETS.replication_password not in str(seen["argv"])
    assert "PRIVATE KEY" not in str(seen["argv"])


@pytest.mark.parametrize("cidr", [SCOPE_CIDR, "10.0.0.0/8 trust"])
def test_seed_refuses_networks_that_are_not_cidrs(cidr: str) -> None:
    """A seed's allowed network must be a bare CIDR: nothing else may reach pg_hba lines."""
    with pytest.raises(ConfigError):
        guest_seed("pgc-01", "primary", (cidr,))


@pytest.mark.parametrize("host", ["fe80::1%x host=10.6.6.6", "db1"])
def test_seed_refuses_a_primary_host_that_is_not_an_address(host: str) -> None:
    """A standby's primary_host goes into a conninfo string: only a bare IP address is accepted."""
    with pytest.raises((ConfigError, ValueError)):
        guest_seed("pgc-01-s1", "standby", primary_host=host)


def test_generated_secrets_fit_both_sides_checks(guest_setup: ModuleType) -> None:
    """Generated passwords are long alphanumerics: no quoting is ever needed in a DSN, conninfo or
    postgresql.conf, and the guest's SECRET_RE accepts them."""
    for _ in range(20):
        secret = new_secret()
        assert re.fullmatch(r"[A-Za-z0-9]{32,128}", secret)
        assert guest_setup.SECRET_RE.match(secret)


# --- 5. the API token ------------------------------------------------------------------------

@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[ManagerService]:
    """A service on libvirt's test driver with instances pgc-01..03."""
    with service_on_test_driver(tmp_path / "state") as service:
        yield service


def _app(service: ManagerService, **settings: object) -> FastAPI:
    return app_for(service, **settings)


def _routes(app: FastAPI, methods: set[str]) -> list[tuple[str, str]]:
    """(method, path) of every route the app documents, plus the routers' hidden ones (the dashboard)."""
    served = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    declared: set[tuple[str, str]] = set()
    for info in pkgutil.iter_modules(routes_package.__path__):
        router = importlib.import_module(f"{routes_package.__name__}.{info.name}").router
        declared |= {(m, r.path) for r in router.routes if isinstance(r, APIRoute) for m in r.methods or ()}
    assert served <= declared
    hidden = {("GET", "/")}
    assert hidden <= declared - served
    return sorted(r for r in served | hidden if r[0] in methods)


MUTATION_BODIES: dict[tuple[str, str], dict[str, object]] = {
    ("DELETE", "/v1/instances/{name}"): {},
    ("PUT", "/v1/scale"): {"instances": 1},
    ("POST", "/v1/instances/{name}/failover"): {"to": "pgc-01-s1", "force": True},
    ("POST", "/v1/instances/{name}/switchover"): {},
    ("POST", "/v1/instances/{name}/backups"): {"type": "full"},
    ("POST", "/v1/advice"): {"max_instances": 2, "seconds": 5, "repeat": 1, "clients": 4},
}
WRONG_AUTH: list[dict[str, str | bytes]] = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": "Bearer " + "x" * len(TOKEN)},
    {"Authorization": "Bearer " + TOKEN[:-1] + ("0" if TOKEN[-1] != "0" else "1")},
    {"Authorization": "Bearer " + TOKEN + "x"},
    {"Authorization": "Bearer " + TOKEN[:-1]},
    {"Authorization": "Bearer " + TOKEN.upper()},
    {"Authorization": TOKEN},
    {"Authorization": "Basic " + TOKEN},
    {"Authorization": "Bearer"},
    {"Authorization": b"Bearer \xe9" + b"x" * (len(TOKEN) - 1)},
    {"X-API-Token": TOKEN},
    {"Cookie": f"token={TOKEN}"},
]


@pytest.mark.parametrize("headers", WRONG_AUTH, ids=range(len(WRONG_AUTH)))
def test_every_mutation_needs_the_exact_token(fleet: ManagerService, headers: dict[str, str | bytes]) -> None:
    """Every PUT/POST/PATCH/DELETE route answers 401 to a missing, wrong, same-length, truncated,
    extended, differently-cased, non-Bearer or non-ASCII token, and nothing starts."""
    app = _app(fleet, token=TOKEN)
    routes = _routes(app, {"PUT", "POST", "PATCH", "DELETE"})
    assert routes == sorted(MUTATION_BODIES), "a new mutating route: add a valid body for it here"
    with TestClient(app, base_url=LOCAL) as client:
        for method, path in routes:
            resp = client.request(method, path, json=MUTATION_BODIES[(method, path)], headers=headers,
                                  params={"token": TOKEN})
            assert resp.status_code == 401, (method, path, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
            assert TOKEN not in resp.text
    assert fleet.operations.all() == []


def test_the_right_token_is_accepted(fleet: ManagerService) -> None:
    """Positive control for the refusals above: the same request with the token is accepted."""
    with TestClient(_app(fleet, token=TOKEN), base_url=LOCAL) as client:
        resp = client.put("/v1/scale", json={"instances": 1}, headers={"Authorization": f"bearer  {TOKEN} "})
        assert resp.status_code == 202, resp.text
    assert fleet.wait_idle(30)


def test_the_token_is_compared_in_constant_time(fleet: ManagerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision comes from hmac.compare_digest alone, for tokens of any length (no early
    length or prefix check): with it forced to False even the right token is refused."""
    calls: list[tuple[object, object]] = []

    def never(a: object, b: object) -> bool:
        calls.append((a, b))
        return False

    monkeypatch.setattr(security.hmac, "compare_digest", never)
    with TestClient(_app(fleet, token=TOKEN), base_url=LOCAL) as client:
        assert client.put("/v1/scale", json={"instances": 1}, headers=AUTH).status_code == 401
        assert client.put("/v1/scale", json={"instances": 1}, headers={"Authorization": "Bearer x"}).status_code == 401
    assert calls == [(TOKEN.encode(), TOKEN.encode()), (b"x", TOKEN.encode())]
    assert fleet.operations.all() == []


@pytest.mark.parametrize("bind, address, url", [
    ("0.0.0.0", "0.0.0.0", "http://127.0.0.1:8080"),  # a wildcard socket, reached over loopback
    ("::", "::", "http://[::1]:8080"),
    ("10.1.2.3", "10.1.2.3", "http://10.1.2.3:8080"),
    ("localhost", "10.1.2.3", "http://localhost:8080"),  # the name says loopback, the socket does not
])
def test_reads_off_loopback_need_the_token(fleet: ManagerService, bind: str, address: str, url: str) -> None:
    """Listening anywhere but loopback, every read route except the liveness probe and the
    (static) dashboard page answers 401 without the token, and works with it. What counts is
    the address the listening socket is bound to, not the bind string nor the address a request
    arrived on."""
    app = create_app(Settings(state_dir=fleet.paths.state_dir, token=TOKEN, bind=bind), service=fleet,
                     listener=Listener(bind=bind, address=address, port=8080))
    open_routes = {("GET", "/healthz"), ("GET", "/")}
    reads = [r for r in _routes(app, {"GET"}) if r not in open_routes]
    assert ("GET", "/v1/instances") in reads and ("GET", "/metrics") in reads and ("GET", "/v1/ca.pem") in reads
    operation = fleet.request_scale(3)  # a scale to the present count: something for /v1/operations/{op_id}
    assert fleet.wait_idle(30)
    AdviceStore(fleet.paths.state_dir / "advice").save("0123456789ab", {"verdict": {"word": "none"}})
    values = {"name": "pgc-01", "op_id": operation.id, "run_id": "0123456789ab"}
    with TestClient(app, base_url=url, client=("10.1.2.3", 5000)) as client:
        for _method, template in reads:
            path = re.sub(r"\{([^}]+)\}", lambda m: values[m.group(1)], template)
            resp = client.get(path, params={"instances": 1})
            assert resp.status_code == 401, (path, resp.status_code)
            if path == "/v1/events":  # an endless stream: read its first event, then hang up
                assert read_stream_start(app, path, headers=AUTH, host=url.split("//", 1)[1]).status == 200
            else:
                assert client.get(path, params={"instances": 1}, headers=AUTH).status_code == 200, path
        assert client.get("/healthz").status_code == 200


def test_a_generated_token_file_is_0600_even_with_a_permissive_umask(fleet: ManagerService) -> None:
    """Without PGCARVE_TOKEN the app generates the token into <state>/api-token, mode 0600 (the
    mode is set at creation, so a permissive umask cannot widen it), and that token works."""
    old = os.umask(0)
    try:
        app = _app(fleet, token=None)
    finally:
        os.umask(old)
    token_file = fleet.paths.token_file
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32 and app.state.token == token
    with TestClient(app, base_url=LOCAL) as client:
        assert client.put("/v1/scale", json={"instances": 3}, headers={"Authorization": f"Bearer {token}"}
                          ).status_code == 202
    assert fleet.wait_idle(30)


def test_the_token_is_never_logged(fleet: ManagerService, caplog: pytest.LogCaptureFixture) -> None:
    """Generating the token, and requests with the right or a wrong token, log nothing that
    contains either token (all loggers, DEBUG)."""
    caplog.set_level(logging.DEBUG)
    app = _app(fleet, token=None)
    token = fleet.paths.token_file.read_text().strip()
    wrong = secrets.token_urlsafe(32)
    with TestClient(app, base_url=LOCAL) as client:
        assert client.put("/v1/scale", json={"instances": 3}, headers={"Authorization": f"Bearer {wrong}"}
                          ).status_code == 401
        assert client.put("/v1/scale", json={"instances": 3}, headers={"Authorization": f"Bearer {token}"}
                          ).status_code == 202
        assert client.get("/v1/instances", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert fleet.wait_idle(30)
    assert any("api-token" in r.getMessage() for r in caplog.records), "the generation notice is logged"
    for record in caplog.records:
        text = record.getMessage() + repr(record.args) + (record.exc_text or "")
        assert token not in text and wrong not in text, record


def test_page_source_never_contains_the_token(fleet: ManagerService) -> None:
    """The dashboard HTML, every static file and the OpenAPI documents are served without the
    token in them (the browser asks the user for it instead)."""
    app = _app(fleet, token=None)
    token = app.state.token
    static_files = sorted(p.relative_to(STATIC_DIR).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file())
    assert "dashboard.js" in static_files and "index.html" in static_files
    with TestClient(app, base_url=LOCAL) as client:
        page = client.get("/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        for path in ["/", "/openapi.json", "/docs", *(f"/static/{f}" for f in static_files)]:
            resp = client.get(path)
            assert resp.status_code == 200, path
            assert token.encode() not in resp.content, path
            assert token not in str(resp.headers), path


# --- 6. body size limit ----------------------------------------------------------------------

LIMIT = 4096
PADDED = b'{"instances": 1' + b" " * (2 * LIMIT) + b"}"  # valid JSON (scale to 1): only its size is wrong


def test_an_oversized_body_is_refused_and_changes_nothing(fleet: ManagerService) -> None:
    """A scale request over max_body_bytes is refused whether its length is declared (413) or
    streamed (chunked), and no operation starts; the same request within the limit would have run."""
    headers = {**AUTH, "content-type": "application/json"}
    with TestClient(_app(fleet, token=TOKEN, max_body_bytes=LIMIT), base_url=LOCAL) as client:
        declared = client.put("/v1/scale", content=PADDED, headers=headers)
        assert declared.status_code == 413 and str(LIMIT) in declared.json()["detail"]
        streamed = client.put("/v1/scale", content=iter([PADDED[:LIMIT], PADDED[LIMIT:]]), headers=headers)
        assert streamed.status_code == 413
        assert fleet.operations.all() == []
        assert len(client.get("/v1/instances").json()) == 3
        small = b'{"instances": 1' + b" " * (LIMIT // 2) + b"}"
        assert client.put("/v1/scale", content=small, headers=headers).status_code == 202
    assert fleet.wait_idle(30)
    assert len(fleet.operations.all()) == 1


def test_an_oversized_chunked_body_gets_413(fleet: ManagerService) -> None:
    """Without Content-Length the limit is enforced while reading, and still answers 413."""
    headers = {**AUTH, "content-type": "application/json"}
    with TestClient(_app(fleet, token=TOKEN, max_body_bytes=LIMIT), base_url=LOCAL) as client:
        streamed = client.put("/v1/scale", content=iter([PADDED[:LIMIT], PADDED[LIMIT:]]), headers=headers)
    assert streamed.status_code == 413, streamed.text
