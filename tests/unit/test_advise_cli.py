"""`pgcarve advise` refuses bad requests before anything is created, and --plan-only changes
nothing: on libvirt's test driver (one primary host, two standby hosts of 128 CPUs each)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pgcarve.advice.host_state import host_state
from pgcarve.advice.plan import AdviceRequest, plan_advice, powers_up_to
from pgcarve.cli import advise_commands
from pgcarve.cli.main import main
from pgcarve.config import FleetConfig, HostConfig, InstanceSize, Replication
from pgcarve.control.fleet import Fleet
from pgcarve.settings import Paths

from bench import simulated_hosts
from tests.support import testdriver as td
from tests.unit.simulated import scaler_of


def fleet_of(tmp_path: Path, standby_hosts: int = 2) -> Fleet:
    hosts = simulated_hosts
    td_file = hosts.ensure_fixture(hosts.TESTDRIVER_FILE, hosts.testdriver_xml())
    caps = hosts.ensure_fixture(hosts.CAPABILITIES_FILE, hosts.capabilities_xml()).read_text()
    uri = f"test://{td_file.resolve()}"
    config = FleetConfig(
        fleet="pgc", domain_type="kvm",
        instance=InstanceSize(vcpus=1, memory_mib=4096, disk_reserve_mib=0),
        replication=Replication(standbys=min(1, standby_hosts)),
        hosts=[HostConfig(name="db1", uri=uri, role="primary"),
               *[HostConfig(name=f"sb{k}", uri=uri, role="standby") for k in range(1, standby_hosts + 1)]])
    paths = Paths(tmp_path / "state", image_dir=td.stand_in_image(tmp_path / "image"))
    return td.testdriver_fleet(config, paths, caps)


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Fleet:
    made = fleet_of(tmp_path)
    monkeypatch.setattr(advise_commands, "open_fleet", lambda _args, _settings: made)
    monkeypatch.setattr(made, "close", lambda: None)  # the test reads the hosts after the command
    return made


def occupy(fleet: Fleet, count: int) -> None:
    """`count` guests of the operator's fleet on db1 (without standbys: the test driver's guests
    never boot, so no standby could clone from them)."""
    raw = fleet.config.model_dump(mode="json")
    raw["hosts"] = raw["hosts"][:1]
    raw["replication"]["standbys"] = 0
    alone = FleetConfig.model_validate(raw)
    scaler_of(Fleet(alone, fleet.paths, hosts={"db1": fleet.hosts["db1"]})).scale(count)


def flat(text: str) -> str:
    """The console wraps long lines: compare with single spaces."""
    return " ".join(text.split())


def advise(*argv: str) -> int:
    return main(["--hosts-file", "/nonexistent/hosts.yaml", "advise", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (("--seconds", "3"), "--seconds 3: each run needs at least 5 s"),
    (("--repeat", "0"), "--repeat 0: at least 1 run"),
    (("--max-instances", "1"), "--max-instances 1: at least 2"),
    (("--clients", "0"), "--clients 0: at least 1"),
    (("--image", "/nonexistent"), "--image /nonexistent: not a guest image directory"),
])
def test_options_wrong_whatever_the_hosts_are_refused_before_any_host_is_read(
        argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fleet(*_a: object) -> Fleet:
        raise AssertionError("a host was read for a request refused on its options")

    monkeypatch.setattr(advise_commands, "open_fleet", no_fleet)
    assert advise(*argv) == 2
    assert message in flat(capsys.readouterr().err)


def test_a_count_above_capacity_is_refused_naming_the_limit(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    before = host_state(fleet)
    assert advise("--max-instances", "100") == 3
    err = flat(capsys.readouterr().err)
    assert "--max-instances 100: host db1 has room for 62 instance(s) of 1 vCPU, 4096 MiB" in err, err
    assert "at most 62" in err
    assert host_state(fleet) == before


def test_a_host_with_guests_is_refused_without_spare(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    occupy(fleet, 2)
    before = host_state(fleet)
    assert advise("--plan-only") == 7
    err = flat(capsys.readouterr().err)
    assert "host db1 holds 2 guest(s) (pgc-01, pgc-02): advise carves an empty host" in err and "--spare" in err
    assert host_state(fleet) == before


def test_spare_uses_only_the_free_slots(fleet: Fleet) -> None:
    occupy(fleet, 2)
    there = fleet.hosts["db1"].guests()
    pinned = {cpu for g in there for pins in g.vcpu_pins for cpu in pins} | {c for g in there for c in g.emulator_cpus}
    plan = plan_advice(fleet, AdviceRequest(spare=True))
    assert plan.occupied == ("pgc-01", "pgc-02") and plan.ns[-1] >= 28, plan.ns
    for group in plan.groups:  # every case: carved guests, and the single and clusters guests of N x V vCPUs
        placed = Fleet(group.config, fleet.paths, hosts=fleet.hosts).placement
        slots = [placed.slot("db1", i) for i in range(1, group.instances + 1)]
        used = {cpu for _, slot in slots for cpu in slot.host_cpus} | set(slots[0][0].emulator_cpus)
        assert used and not used & pinned, f"{group.label} would share CPUs with the guests already there"


def test_the_standby_hosts_are_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    alone = fleet_of(tmp_path, standby_hosts=0)
    monkeypatch.setattr(advise_commands, "open_fleet", lambda _args, _settings: alone)
    assert advise("--plan-only") == 2
    assert "the hosts file has no host with role: standby" in flat(capsys.readouterr().err)


def test_a_standby_host_or_an_unknown_host_is_not_carved(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    assert advise("--host", "sb1", "--plan-only") == 2
    assert "--host sb1: a standby host" in flat(capsys.readouterr().err)
    assert advise("--host", "nope", "--plan-only") == 2
    assert "--host nope: not in the hosts file (hosts: db1, sb1, sb2)" in flat(capsys.readouterr().err)


def test_plan_only_says_what_it_would_carve_and_changes_nothing(fleet: Fleet,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    before = host_state(fleet)
    assert advise("--plan-only", "--max-instances", "8", "--seconds", "60", "--clients", "64") == 0
    text = flat(capsys.readouterr().out)
    assert "nothing is created" in text
    for line in ("carved-1: 1 instance(s) of 1 vCPU + 1 standby guest(s)",
                 "carved-8: 8 instance(s) of 1 vCPU + 8 standby guest(s)",
                 "single: 1 instance(s) of 8 vCPU + 1 standby guest(s)",
                 "multi-instance: 1 instance(s) of 8 vCPU, 8 PostgreSQL clusters + 1 standby guest(s)",
                 "18 pgbench runs of 60 s (3 round(s)), 64 clients per case; guests: kvm",
                 "estimated time: about"):
        assert line in text, text
    assert host_state(fleet) == before
    assert advise("--plan-only", "--max-instances", "4", "--format", "json") == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["instances"] == [1, 2, 4] and doc["clients"] == "ramp" and doc["single_vcpus"] == 4
    assert doc["estimate_s"] > 3 * 5 * 30


def test_n_values_double_up_to_the_largest() -> None:
    assert powers_up_to(2) == (1, 2)
    assert powers_up_to(8) == (1, 2, 4, 8)
    assert powers_up_to(62) == (1, 2, 4, 8, 16, 32, 62)
