"""A manager never makes the fleet's admin password or CA anew over running guests (issue 32,
item 2): with guests and without those files, `pgcarve serve` and `pgcarve up` refuse and name
what to restore, and make nothing. On libvirt's test driver."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pgcarve.control.fleet import Fleet
from pgcarve.control.state_check import check_state
from pgcarve.errors import ConfigError
from pgcarve_api import server

from tests.support.localpg import free_ports
from tests.unit.simulated import one_host_fleet, scaler_of


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = one_host_fleet(tmp_path)
    yield f
    f.close()


def test_an_empty_fleet_starts_from_an_empty_state_directory(fleet: Fleet) -> None:
    check_state(fleet)  # nothing to lock out: a new fleet makes its secrets on first use
    scaler_of(fleet).scale(1)
    assert fleet.paths.secrets_file.exists() and fleet.ca.cert_file.exists()
    check_state(fleet)


@pytest.mark.parametrize("lost", ["secrets", "ca", "both"])
def test_guests_without_their_secrets_refuse_and_make_nothing(fleet: Fleet, lost: str) -> None:
    scaler_of(fleet).scale(1)
    if lost in ("secrets", "both"):
        fleet.paths.secrets_file.unlink()
    if lost in ("ca", "both"):
        shutil.rmtree(fleet.paths.tls_dir)
    with pytest.raises(ConfigError) as refused:
        check_state(fleet)
    message = " ".join(str(refused.value).split())
    print(message)
    assert "has guests (pgcbench-01" in message and "restore them from a backup" in message, message
    assert ("admin password" in message) == (lost in ("secrets", "both"))
    assert ("fleet CA" in message) == (lost in ("ca", "both"))
    assert fleet.paths.secrets_file.exists() == (lost == "ca")
    assert fleet.ca.cert_file.exists() == (lost == "secrets")


def test_serve_refuses_before_it_makes_a_token_or_listens(fleet: Fleet, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    scaler_of(fleet).scale(1)
    fleet.paths.secrets_file.unlink()
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(fleet.config.model_dump(mode="json")))
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(fleet.paths.state_dir))
    monkeypatch.delenv("PGCARVE_TOKEN", raising=False)
    # A test:///FILE connection is a host of its own: the server must see this one.
    monkeypatch.setattr(server, "Fleet", lambda *_args, **_kwargs: fleet)
    monkeypatch.setattr(fleet, "close", lambda: None)
    port = free_ports(1)[0]
    assert server.main(["--hosts-file", str(hosts_file), "--port", str(port)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the API server did not start" in err and "admin password" in err, err
    assert not fleet.paths.secrets_file.exists() and not fleet.paths.token_file.exists()
    assert not fleet.paths.server_file.exists()


def test_a_passwords_file_others_can_read_stops_the_start(fleet: Fleet) -> None:
    scaler_of(fleet).scale(1)
    for path in (fleet.paths.secrets_file, *fleet.paths.instance_secrets_dir.glob("*.json")):
        assert path.stat().st_mode & 0o777 == 0o600, path
        path.chmod(0o644)
        with pytest.raises(ConfigError, match=r"chmod 600"):
            check_state(fleet)
        path.chmod(0o600)
    check_state(fleet)
