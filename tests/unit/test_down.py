"""`pgcarve down` deletes a fleet only when asked for it by name: never while a manager serves the
fleet, on hosts other than the local sandbox only with --real-hosts, and only after listing, in
bytes, every database it deletes. Refusals change nothing. On libvirt's test driver (the real
Fleet, Scaler and removal; no guest boots)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pgcarve.cli import fleet_commands
from pgcarve.cli.main import main
from pgcarve.control.fleet import Fleet
from pgcarve.processes import record_self, write_record

from tests.unit.simulated import one_host_fleet, scaler_of


@pytest.fixture
def fleet_of_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Fleet, Path]]:
    """Two instances, one of them retired, on one test-driver host; the hosts file that names it,
    and the CLI's state directory pointed at the same place."""
    fleet = one_host_fleet(tmp_path)
    scaler = scaler_of(fleet)
    scaler.scale(2)
    scaler.scale(1)  # the second one retired: its disks kept
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(fleet.config.model_dump(mode="json")))
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(fleet.paths.state_dir))
    monkeypatch.setenv("PGCARVE_IMAGE_DIR", str(fleet.paths.image_dir))
    # A test:///FILE connection is a host of its own: the command must see this one.
    monkeypatch.setattr(fleet_commands, "Fleet", lambda *_args, **_kwargs: fleet)
    yield fleet, hosts_file
    fleet.close()


def said(text: str) -> str:
    """What the command printed, with the terminal's line wrapping undone."""
    return " ".join(text.split())


def volumes(fleet: Fleet) -> set[str]:
    return {v for host in fleet.hosts.values() for v in host.storage.volume_names()}


def test_refused_while_a_manager_serves_the_fleet(fleet_of_two: tuple[Fleet, Path],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fleet, hosts_file = fleet_of_two
    before = volumes(fleet)
    write_record(fleet.paths.server_file, record_self(), url="http://127.0.0.1:8080")
    code = main(["--hosts-file", str(hosts_file), "down", "--real-hosts", "--confirm", fleet.config.fleet])
    err = said(capsys.readouterr().err)
    assert code != 0 and "a pgcarve server" in err and "pgcarve server stop" in err, err
    assert volumes(fleet) == before and len(fleet.observe()) == 1


def test_hosts_other_than_the_sandbox_need_real_hosts(fleet_of_two: tuple[Fleet, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    fleet, hosts_file = fleet_of_two
    before = volumes(fleet)
    code = main(["--hosts-file", str(hosts_file), "down", "--confirm", fleet.config.fleet])
    err = said(capsys.readouterr().err)
    assert code != 0 and "not this machine's running sandbox" in err and "--real-hosts" in err, err
    assert volumes(fleet) == before and len(fleet.observe()) == 1


def test_lists_what_it_deletes_in_bytes_and_needs_the_fleets_name(fleet_of_two: tuple[Fleet, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fleet, hosts_file = fleet_of_two
    name = fleet.config.fleet
    before = volumes(fleet)
    code = main(["--hosts-file", str(hosts_file), "down", "--real-hosts"])  # no terminal to ask on
    captured = capsys.readouterr()
    listed = said(captured.out)
    assert code != 0 and f"--confirm {name}" in said(captured.err), captured
    assert f"{name}-01 running" in listed and f"{name}-02 retired" in listed, listed
    assert "bytes" in listed and "in all:" in listed, listed
    assert volumes(fleet) == before, "a refusal deletes nothing"

    wrong = main(["--hosts-file", str(hosts_file), "down", "--real-hosts", "--confirm", "another"])
    assert wrong != 0 and volumes(fleet) == before

    assert main(["--hosts-file", str(hosts_file), "down", "--real-hosts", "--confirm", name]) == 0
    out = said(capsys.readouterr().out)
    assert "removed 1 instance(s) and 1 retired one(s)" in out, out
    assert fleet.observe() == [] and not [v for v in volumes(fleet) if v.startswith(f"{name}-")]
