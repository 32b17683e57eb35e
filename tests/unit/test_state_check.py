"""A manager never makes the fleet's admin password, CA or an instance's passwords anew over a fleet
in use (issue 32, item 2): with guests, retired disks, recorded instances or unfinished operations
and without those files, `pgcarve serve`, `pgcarve up` and every command that loads the fleet
refuse, name what is missing and how to restore it, and change nothing. Only a new fleet gets new
ones. On libvirt's test driver."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pgcarve.cli import fleet_commands
from pgcarve.cli.main import main as cli_main
from pgcarve.control.fleet import Fleet
from pgcarve.control.retired import retired_instances
from pgcarve.control.state_check import check_state, prepare_state
from pgcarve.errors import ConfigError, StateMissing
from pgcarve.guest.credentials import load_credentials
from pgcarve_api import server

from tests.support.localpg import free_ports
from tests.support.testdriver import testdriver_hosts
from tests.unit.simulated import one_host_fleet, scaler_of


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = one_host_fleet(tmp_path)
    yield f
    f.close()


def _snapshot(fleet: Fleet) -> tuple[object, ...]:
    """Everything a refusal must leave as it was: each file of the state directory (content, mode),
    each domain's XML, each retired disk."""
    files = {str(p.relative_to(fleet.paths.state_dir)): (p.read_bytes(), p.stat().st_mode)
             for p in sorted(fleet.paths.state_dir.rglob("*")) if p.is_file()}
    dirs = sorted(str(p) for p in fleet.paths.state_dir.rglob("*") if p.is_dir())
    domains = {(h, g.name): host.domain_xml(g.name) for h, host in testdriver_hosts(fleet).items()
               for g in host.guests(fleet.config.fleet)}
    retired = [(r.name, r.disk_mib) for r in retired_instances(fleet)]
    return files, dirs, domains, retired


def _message(refused: pytest.ExceptionInfo[ConfigError]) -> str:
    return " ".join(str(refused.value).split())


def test_a_new_fleet_gets_its_secrets_once(fleet: Fleet) -> None:
    fleet.paths.secrets_file.unlink()
    shutil.rmtree(fleet.paths.tls_dir)
    check_state(fleet)  # a command that makes nothing: nothing to lock out, nothing made
    assert not fleet.paths.secrets_file.exists() and not fleet.ca.exists()
    with pytest.raises(StateMissing, match="pgcarve state import"):
        fleet.credentials
    made = prepare_state(fleet)
    assert len(made) == 2 and fleet.paths.secrets_file.exists() and fleet.ca.cert_file.exists()
    password, ca = load_credentials(fleet.paths.secrets_file), fleet.ca.load()
    scaler_of(fleet).scale(1)
    assert prepare_state(fleet) == [] and check_state(fleet).guests == ("pgcbench-01",)
    assert load_credentials(fleet.paths.secrets_file) == password and fleet.ca.load() == ca


@pytest.mark.parametrize("lost", ["secrets", "ca", "ca-key", "both"])
def test_guests_without_their_secrets_refuse_and_change_nothing(fleet: Fleet, lost: str) -> None:
    scaler_of(fleet).scale(1)
    if lost in ("secrets", "both"):
        fleet.paths.secrets_file.unlink()
    if lost in ("ca", "both"):
        shutil.rmtree(fleet.paths.tls_dir)
    if lost == "ca-key":
        fleet.ca.key_file.unlink()
    before = _snapshot(fleet)
    for check in (check_state, prepare_state):
        with pytest.raises(StateMissing) as refused:
            check(fleet)
        message = _message(refused)
        assert "fleet 'pgcbench' is in use (guests (pgcbench-01)" in message, message
        assert "pgcarve state import BACKUP --key-file KEY" in message and str(fleet.paths.state_dir) in message
        assert ("secrets.json (the fleet's admin password)" in message) == (lost in ("secrets", "both"))
        assert ("ca.key (the fleet CA's key)" in message) == (lost != "secrets")
        assert _snapshot(fleet) == before, "a refusal changes nothing"


def test_an_instance_without_its_passwords_refuses(fleet: Fleet) -> None:
    scaler_of(fleet).scale(2)
    (fleet.paths.instance_secrets_dir / "pgcbench-02.json").unlink()
    before = _snapshot(fleet)
    with pytest.raises(StateMissing) as refused:
        prepare_state(fleet)
    message = _message(refused)
    assert "instances/pgcbench-02.json (instance pgcbench-02's passwords)" in message, message
    assert "pgcbench-01.json" not in message
    assert _snapshot(fleet) == before


def test_retired_disks_alone_are_a_fleet_in_use(fleet: Fleet) -> None:
    scaler_of(fleet).scale(1)
    scaler_of(fleet).scale(0)  # retires: no domain left, the disks are kept
    assert fleet.guests() == [] and [r.name for r in retired_instances(fleet)] == ["pgcbench-01"]
    shutil.rmtree(fleet.paths.tls_dir)
    before = _snapshot(fleet)
    with pytest.raises(StateMissing) as refused:
        prepare_state(fleet)
    assert "retired instances (pgcbench-01)" in _message(refused)
    assert _snapshot(fleet) == before


def test_the_state_directory_alone_can_show_a_fleet(fleet: Fleet) -> None:
    """Recorded instances or unfinished operations, with no guest found (their host lost its
    domains, or the hosts file names other hosts): still no new secrets."""
    fleet.paths.secrets_file.unlink()
    fleet.paths.instance_secrets_dir.mkdir(parents=True, exist_ok=True)
    (fleet.paths.instance_secrets_dir / "pgcbench-07.json").write_text("{}")
    (fleet.paths.instance_secrets_dir / "pgcbench-07.json").chmod(0o600)
    with pytest.raises(StateMissing) as refused:
        prepare_state(fleet)
    message = _message(refused)
    assert "instances recorded in the state directory (pgcbench-07)" in message
    assert f"move {fleet.paths.instance_secrets_dir}" in message, "says how to start anew if that fleet is gone"
    (fleet.paths.instance_secrets_dir / "pgcbench-07.json").unlink()
    journal = fleet.paths.state_dir / "operations.json"
    journal.write_text(json.dumps([{"id": "op-1", "kind": "scale", "status": "running"}]))
    with pytest.raises(StateMissing, match=r"unfinished operations \(op-1 \(scale\)\)"):
        prepare_state(fleet)
    journal.write_text(json.dumps([{"id": "op-1", "kind": "scale", "status": "succeeded"}]))
    assert prepare_state(fleet) == [f"{fleet.paths.secrets_file} (a new fleet admin password)"]


def test_a_command_that_loads_the_fleet_refuses(fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    scaler_of(fleet).scale(1)
    shutil.rmtree(fleet.paths.tls_dir)
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(fleet.config.model_dump(mode="json")))
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(fleet.paths.state_dir))
    # A test:///FILE connection is a host of its own: the command must see this one.
    monkeypatch.setattr(fleet_commands, "Fleet", lambda *_args, **_kwargs: fleet)
    monkeypatch.setattr(fleet, "close", lambda: None)
    before = _snapshot(fleet)
    for argv in (["status", "--local"], ["up", "--instances", "2"], ["plan", "--instances", "1", "--format", "tfvars"]):
        assert cli_main(["--hosts-file", str(hosts_file), *argv]) == 2, argv
        printed = capsys.readouterr()
        err = " ".join((printed.out + printed.err).split())
        assert "is in use (guests (pgcbench-01)" in err and "ca.key (the fleet CA's key)" in err, err
        assert "pgcarve state import" in err
        assert _snapshot(fleet) == before, argv


def test_serve_refuses_before_it_makes_a_token_or_listens(fleet: Fleet, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    scaler_of(fleet).scale(1)
    fleet.paths.secrets_file.unlink()
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(fleet.config.model_dump(mode="json")))
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(fleet.paths.state_dir))
    monkeypatch.delenv("PGCARVE_TOKEN", raising=False)
    monkeypatch.setattr(server, "Fleet", lambda *_args, **_kwargs: fleet)
    monkeypatch.setattr(fleet, "close", lambda: None)
    port = free_ports(1)[0]
    assert server.main(["--hosts-file", str(hosts_file), "--port", str(port)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the API server did not start" in err and "admin password" in err, err
    assert not fleet.paths.secrets_file.exists() and not fleet.paths.token_file.exists()
    assert not fleet.paths.server_file.exists()


def test_secret_files_others_can_read_are_made_0600_at_start(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    scaler_of(fleet).scale(1)
    fleet.paths.token_file.write_text("t" * 43)
    opened = [fleet.paths.secrets_file, fleet.ca.key_file, fleet.paths.token_file,
              *fleet.paths.instance_secrets_dir.glob("*.json")]
    for path in opened:
        path.chmod(0o644)
    fleet.paths.instance_secrets_dir.chmod(0o755)
    fleet.ca.cert_file.chmod(0o644)
    check_state(fleet)
    for path in opened:
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert fleet.paths.instance_secrets_dir.stat().st_mode & 0o777 == 0o700
    assert fleet.ca.cert_file.stat().st_mode & 0o777 == 0o644, "a certificate is public: left as it is"
    said = " ".join(caplog.text.split())
    for path in opened:
        assert f"{path} (" in said, path
    assert "could be read by group or others (mode 0644); it is 0600 now" in said
    assert "may have copied it" in said
    caplog.clear()
    check_state(fleet)
    assert "could be read" not in caplog.text, "said once, when it was fixed"
