"""A new guest's boot watched by stage (control/boot_watch.py): what its console says, which stage
it is at, when it counts as stuck and what the operator is told; and the provisioner building a
guest stuck in its first boot again, once (control/provisioning.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pgcarve.config import HostConfig
from pgcarve.control import boot_watch
from pgcarve.control.boot_watch import BootBounds, BootWatch, bounds_for, fatal_in, setup_step
from pgcarve.control.fleet import Guest, Progress, no_progress
from pgcarve.errors import GuestStuck
from pgcarve.virt.console import readable
from pgcarve.virt.domain_xml import InstanceMetadata

from tests.unit.test_provisioning_order import Recorder, _info

CONSOLES = Path(__file__).resolve().parents[1] / "data" / "consoles"


def console(name: str) -> str:
    return readable((CONSOLES / name).read_text(errors="replace"))


# -- what a console says ---------------------------------------------------------------------


def test_a_recorded_panic_is_fatal_and_said_in_words() -> None:
    assert fatal_in(console("panic.log")) == 'its kernel panicked ("Kernel panic - not syncing: sysrq triggered crash")'


def test_a_recorded_healthy_boot_is_not_fatal_and_its_last_set_up_step_is_read() -> None:
    text = console("rejoin-boot.log")
    assert fatal_in(text) is None
    assert setup_step(text) == "rejoin: replaying this former primary's own WAL (crash recovery, single-user mode)"
    assert "\x1b" not in text and "]104" not in text, "terminal control sequences are left in the text"


def test_emergency_mode_is_fatal() -> None:
    text = "You are in emergency mode. After logging in, type \"journalctl -xb\" to view system logs"
    said = fatal_in(text) or ""
    assert said.startswith('systemd stopped in emergency mode (a disk or file system did not come up) '
                           '("You are in emergency mode.')


def test_bounds_follow_the_domain_type_and_never_pass_the_boot_timeout() -> None:
    assert bounds_for("kvm", 600) == BootBounds(60, 30, 600)
    tcg = bounds_for("qemu", 600)
    assert tcg.system_s > 60 and tcg.address_s > 30 and tcg.sql_s == 600
    assert bounds_for("qemu", 30).system_s == 30


# -- the watch -------------------------------------------------------------------------------


class FakeConsole:
    def __init__(self, host: Any, name: str) -> None:
        self.printed = ""
        self.readable = True

    def drain(self) -> None:
        pass

    def text(self) -> str:
        return self.printed

    def tail(self, lines: int = 8) -> list[str]:
        return [line for line in self.printed.splitlines() if line.strip()][-lines:]

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.printed)
        return path

    def close(self) -> None:
        pass


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    answers = {"up": False}
    monkeypatch.setattr(boot_watch, "ConsoleTap", FakeConsole)
    monkeypatch.setattr(boot_watch, "agent_answers", lambda lv, name: answers["up"])
    monkeypatch.setattr(boot_watch, "guest_addresses", lambda lv, name: {"10.77.1.7"} if answers["up"] else set())
    return answers


def watch(tmp_path: Path, seconds_ago: float) -> BootWatch:
    w = BootWatch(SimpleNamespace(name="h1"), "pgc-01-s1", "qemu", 600, tmp_path)  # type: ignore[arg-type]
    w.bounds = BootBounds(system_s=100, address_s=50, sql_s=600)
    w.started -= seconds_ago
    return w


def test_a_boot_within_its_bounds_says_what_it_waits_for(tmp_path: Path, agent: dict[str, bool]) -> None:
    w = watch(tmp_path, 50)
    assert w.check(None) == "waiting until its system is up (the guest agent answers)"
    agent["up"] = True
    w._agent_asked = float("-inf")
    w.console.printed = "pgcarve-guest-setup[221]: pgcarve-guest-setup: cloning from 10.77.0.5\n"  # type: ignore[attr-defined]
    assert w.check(None) == "waiting until it holds an address (set-up: cloning from 10.77.0.5)"
    w._agent_asked = float("-inf")
    assert w.check("10.77.1.7").startswith("waiting until PostgreSQL accepts the manager's login")


def test_no_address_past_its_bound_is_stuck_at_that_stage_with_the_console_kept(
        tmp_path: Path, agent: dict[str, bool]) -> None:
    agent["up"] = True
    w = watch(tmp_path, 151)
    w.check(None)
    w.reached["system"] = 100.0  # its agent answered at 100 s
    w.console.printed = "Debian GNU/Linux 13 pgc-01-s1 ttyS0\n\npgc-01-s1 login: \n"  # type: ignore[attr-defined]
    with pytest.raises(GuestStuck) as stuck:
        w.check(None)
    assert stuck.value.stage == "address"
    message = str(stuck.value)
    assert "pgc-01-s1 on h1: boot stopped at stage 'address'" in message
    assert "it got no address (no DHCP lease), not within 50 s of its system coming up" in message
    assert "reached: system at " in message and "pgc-01-s1 login:" in message
    kept = list(tmp_path.glob("pgc-01-s1-*.log"))
    assert len(kept) == 1 and str(kept[0]) in message


def test_the_system_bound_counts_from_the_wait_for_a_guest_waited_for_late(
        tmp_path: Path, agent: dict[str, bool]) -> None:
    """A standby started with its primary is waited for once the primary answers: its system
    gets the whole bound from then, as it had the whole boot timeout before stages were watched."""
    w = watch(tmp_path, 150)  # started 150 s ago, waited for from now; its system bound is 100 s
    assert w.check(None).startswith("waiting until its system is up")
    w.waited -= 101
    with pytest.raises(GuestStuck) as stuck:
        w.check(None)
    assert stuck.value.stage == "system" and "never came up" in str(stuck.value)


def test_a_lease_the_guest_does_not_hold_is_not_its_address(tmp_path: Path, agent: dict[str, bool]) -> None:
    """A lease listed on the host for the guest's MAC may be a former guest's of the same name: the
    address counts once the guest's own agent reports it."""
    w = watch(tmp_path, 20)
    assert w.check("10.77.1.99").startswith("waiting until its system is up")
    agent["up"] = True
    w._agent_asked = float("-inf")
    assert w.check("10.77.1.99").startswith("waiting until it holds an address")
    w._agent_asked = float("-inf")
    assert w.check("10.77.1.7").startswith("waiting until PostgreSQL")


def test_a_panic_ends_the_wait_at_once(tmp_path: Path, agent: dict[str, bool]) -> None:
    w = watch(tmp_path, 5)
    w.console.printed = console("panic.log")  # type: ignore[attr-defined]
    with pytest.raises(GuestStuck) as stuck:
        w.check(None)
    message = str(stuck.value)
    assert stuck.value.stage == "system" and ': its kernel panicked ("Kernel panic - not syncing: sysrq' in message
    assert "never came up" not in message, "the console's word, not the stage's guess"
    assert "sysrq: Trigger a crash" in message and "RAX:" not in message and "+0x" not in message, message


# -- built again once --------------------------------------------------------------------------


class Rebuilder(Recorder):
    """The real orchestration with guests that get stuck in their first boots as told."""

    def __init__(self, events: list[str], stuck: dict[str, int]) -> None:
        super().__init__(events, reserved="10.77.0.5")
        self.stuck = stuck
        fleet: Any = self.fleet
        for lv in fleet.hosts.values():
            lv.destroy = lambda name, undefine=True: self.events.append(f"destroy {name}")
            lv.storage = SimpleNamespace(delete_volume=lambda volume: self.events.append(f"delete {volume}"))
        fleet.planned_stops = SimpleNamespace(will_stop=lambda name: None)
        fleet.forwards = SimpleNamespace(remove=lambda name: None)

    def create_guest(self, host: HostConfig, name: str, meta: InstanceMetadata, seed: Any,
                     progress: Progress) -> None:
        super().create_guest(host, name, meta, seed, progress)
        self._made[name] = (meta, seed)

    def _ready(self, host: HostConfig, name: str, progress: Progress, standby: bool | None) -> Guest:
        if self.stuck.get(name, 0) > 0:
            self.stuck[name] -= 1
            self.events.append(f"stuck {name}")
            raise GuestStuck(f"{name} on {host.name}: boot stopped at stage 'address'", "address")
        return super()._ready(host, name, progress, standby)


@pytest.fixture(autouse=True)
def _no_guests(monkeypatch: pytest.MonkeyPatch) -> None:
    from pgcarve.control import provisioning
    monkeypatch.setattr(provisioning, "initial_record", lambda *args: None)
    monkeypatch.setattr(provisioning, "refresh_replication_access", lambda fleet, index: {})
    monkeypatch.setattr(provisioning, "failpoint", lambda name: None)
    monkeypatch.setattr(provisioning.replication, "create_slot", lambda conn, slot: None)
    monkeypatch.setattr(provisioning, "after_failed_create", lambda fleet, index, exc, replaying: None)


def test_a_standby_stuck_in_its_first_boot_is_built_again_once_with_the_same_name() -> None:
    events: list[str] = []
    Rebuilder(events, {"pgc-01-s1": 1}).create_instance(1)
    its = [e for e in events if "pgc-01-s1" in e]  # the standbys are waited for side by side
    assert its == ["start pgc-01-s1 (pgc-01-s1 streams from 10.77.0.5)", "stuck pgc-01-s1",
                   "destroy pgc-01-s1", "delete pgc-01-s1.qcow2", "delete pgc-01-s1-seed.iso",
                   "start pgc-01-s1 (pgc-01-s1 streams from 10.77.0.5)", "ready pgc-01-s1",
                   "complete pgc-01-s1"], events
    assert "streaming" in events


def test_a_primary_stuck_twice_fails_with_both_diagnoses() -> None:
    events: list[str] = []
    with pytest.raises(GuestStuck) as failed:
        Rebuilder(events, {"pgc-01": 2}).create_instance(1)
    assert events.count("start pgc-01") == 2 and events.count("stuck pgc-01") == 2
    assert "did not boot, twice. First: " in str(failed.value) and "Then, built again: " in str(failed.value)


def test_a_guest_with_data_is_never_rebuilt() -> None:
    """The provisioner's readiness for a guest it did not just create (a rejoin, a revival) lets
    the stuck boot fail as it is: only a guest holding no data yet is destroyed."""
    events: list[str] = []
    provisioner = Rebuilder(events, {"pgc-01-s1": 1})
    with pytest.raises(GuestStuck):
        provisioner.ready_once_rebuilt(HostConfig(name="h1", uri="test:///default"), "pgc-01-s1", no_progress, True)
    assert not any(e.startswith(("destroy", "delete")) for e in events)
    assert _info("pgc-01-s1", "h1").state == "running"
