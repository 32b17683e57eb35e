"""What the HA loop may do to a guest depends on who created it (issue 15): anything to the
manager's own; to Terraform's, only what changes nothing Terraform owns (restart, failover,
rejoin, follow). A rebuild or a missing standby is left to `terraform apply`, reported once.

On libvirt's test driver: two hosts (h1 primary, h2 standby), each a test:///FILE connection
with state of its own. No guest boots, so the provisioner here takes a running domain as an
answering PostgreSQL, and a guest named "broken" as one that stops again while it boots.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pytest
from pgcarve.config import FleetConfig, HostConfig, InstanceSize, RecoveryPolicy, Replication
from pgcarve.control import recovery
from pgcarve.control.fleet import Fleet, Guest, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.recovery import Action, Repairer, manager_may
from pgcarve.control.supervisor import Incident, Supervisor
from pgcarve.errors import GuestNotReady
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import DomainSpec, Nic, mac_for
from pgcarve.virt.events import GuestEvent
from pgcarve.virt.host import GuestInfo

from bench import simulated_hosts
from tests.support import testdriver as td
from tests.support.domains import FLEET, guest_spec, reset_test_driver

# -- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize(("action", "by_terraform"), [
    (Action.RESTART, True),
    (Action.FAILOVER, True),
    (Action.REJOIN, True),
    (Action.FOLLOW, True),
    (Action.REBUILD, False),
    (Action.REMOVE, False),
])
def test_what_the_manager_may_do_to_whose_guest(action: Action, by_terraform: bool) -> None:
    assert manager_may(action, "manager")
    assert manager_may(action, "terraform") is by_terraform


def test_every_repair_action_is_in_the_table() -> None:
    """A new Action must be placed on one side of the rule, not fall through unnoticed."""
    ruled = {Action.RESTART, Action.FAILOVER, Action.REJOIN, Action.FOLLOW, Action.REBUILD, Action.REMOVE}
    assert set(Action) - {Action.NONE} == ruled
    assert not manager_may(Action.REBUILD, "someone-else")


# -- a two-host fleet on the test driver -----------------------------------------------------


@dataclass
class World:
    fleet: Fleet
    provisioner: FakeProvisioner
    removed: list[str]

    def define(self, host: str, index: int, standby: int = 0,
               created_by: Literal["manager", "terraform"] = "terraform",
               running: bool = True) -> str:
        """Guest `standby` (0: the primary) of instance `index` on `host`, as Terraform or the
        manager would define it."""
        spec = guest_spec(index, standby=standby)
        spec = replace(spec, metadata=replace(spec.metadata, created_by=created_by),
                       nics=(Nic("pgcarve", mac_for(FLEET, spec.name)),))
        lv = self.fleet.hosts[host]
        if running:
            lv.define_and_start(spec)
        else:
            lv.define(spec)
        return spec.name

    def state(self, host: str, name: str) -> str:
        return self.fleet.hosts[host].guest(name).state


class FakeProvisioner(Provisioner):
    """Readiness without PostgreSQL: a running guest answers at once; a guest in `broken` stops
    again while booting (its disk is damaged, say). A standby "built" is a bare domain, and
    `built` lists each one."""

    def __init__(self, fleet: Fleet):
        super().__init__(fleet)
        self.broken: set[str] = set()
        self.built: list[str] = []

    def wait_sql(self, host: HostConfig, name: str, progress: Progress, standby: bool | None = False) -> Guest:
        lv = self.fleet.hosts[host.name]
        if name in self.broken:
            lv.stop(name)
            raise GuestNotReady(f"{name} on {host.name} stopped while booting (state shutoff)")
        return Guest(info=lv.guest(name), address=None, endpoint=None)

    def create_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                       progress: Progress = no_progress, from_image: bool = False) -> Guest:
        self.built.append(f"{name} on {host.name}")
        meta = replace(primary.info.metadata, role="standby", standby=number)
        spec = DomainSpec(name=name, domain_type="qemu", metadata=meta, memory_mib=1024, vcpu_pins=(3,),
                          emulator_cpus=(0,), numa_node=0, kernel="/nonexistent/vmlinuz",
                          initrd="/nonexistent/initrd.img", disks=(),
                          nics=(Nic("pgcarve", mac_for(FLEET, name)),))
        self.fleet.hosts[host.name].define_and_start(spec)
        return Guest(info=self.fleet.hosts[host.name].guest(name), address=None, endpoint=None)


def fleet_of_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, standby_hosts: int, replication: Replication,
                   recovery_policy: RecoveryPolicy) -> tuple[Fleet, list[str]]:
    """A fleet on the test driver: h1 for primaries, h2.. for standbys. No guest has an address,
    and the list returned records each guest a repair removes ("<guest> on <host>")."""
    node = simulated_hosts.ensure_fixture(simulated_hosts.TESTDRIVER_FILE, simulated_hosts.testdriver_xml())
    caps = simulated_hosts.ensure_fixture(simulated_hosts.CAPABILITIES_FILE,
                                          simulated_hosts.capabilities_xml()).read_text()
    uri = f"test://{node.resolve()}"
    config = FleetConfig(fleet=FLEET, domain_type="qemu",
                         instance=InstanceSize(vcpus=1, memory_mib=1024, disk_reserve_mib=0),
                         replication=replication, recovery=recovery_policy,
                         hosts=[HostConfig(name="h1", uri=uri, role="primary"),
                                *(HostConfig(name=f"h{n}", uri=uri, role="standby")
                                  for n in range(2, standby_hosts + 2))])
    fleet = td.testdriver_fleet(config, Paths(tmp_path / "state"), caps)
    # No guest boots, so none has an address (the node file's leases would send tests off the machine).
    monkeypatch.setattr(fleet, "reach", lambda info, with_endpoint=True: Guest(info=info, address=None,
                                                                               endpoint=None))
    removed: list[str] = []
    real_remove = recovery.remove_guest

    def remove_guest(fleet: Fleet, info: GuestInfo) -> None:
        removed.append(f"{info.name} on {info.host}")
        real_remove(fleet, info)

    monkeypatch.setattr(recovery, "remove_guest", remove_guest)
    return fleet, removed


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    fleet, removed = fleet_of_hosts(tmp_path, monkeypatch, 1, Replication(standbys=1, sync_count=1),
                                    RecoveryPolicy(primary="restart"))
    yield World(fleet, FakeProvisioner(fleet), removed)
    fleet.close()


def supervising(w: World) -> tuple[Supervisor, list[int]]:
    """A supervisor over the world that is not started: the test sweeps it by hand. Its repairs
    use the world's provisioner; the list holds each repair attempt's instance index."""
    supervisor = Supervisor(w.fleet, sweep_s=3600, retry_s=0)
    supervisor.repairer = Repairer(w.fleet, w.provisioner)
    attempts: list[int] = []
    repair = supervisor.repairer.repair

    def counted(index: int, policy: str, host_lost: bool = False, isolated: bool = False,
                progress: Progress = no_progress) -> recovery.RepairResult:
        attempts.append(index)
        return repair(index, policy, host_lost, isolated, progress)

    supervisor.repairer.repair = counted  # type: ignore[method-assign]
    return supervisor, attempts


def settled(supervisor: Supervisor, count: int, timeout_s: float = 20) -> list[Incident]:
    """The supervisor's incidents once there are `count` and none is being repaired."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = supervisor.incidents()
        if len(found) >= count and all(i.status != "recovering" for i in found) and not supervisor._running:
            return found
        time.sleep(0.02)
    raise AssertionError(f"incidents did not settle: {supervisor.incidents()}")


# -- Terraform's instances -------------------------------------------------------------------


def test_a_stopped_terraform_primary_is_started_again(world: World) -> None:
    world.define("h1", 1)
    world.define("h2", 1, standby=1)
    world.fleet.hosts["h1"].stop("pgc-01")
    supervisor, attempts = supervising(world)
    supervisor._sweep()
    [incident] = settled(supervisor, 1)
    assert (incident.guest, incident.what) == ("pgc-01", "primary not running")
    assert (incident.status, incident.action) == ("recovered", "restart"), incident
    assert world.state("h1", "pgc-01") == "running"
    assert attempts == [1]
    assert world.removed == [] and world.provisioner.built == []


def test_a_terraform_standby_that_cannot_start_is_left_to_terraform(world: World) -> None:
    world.define("h1", 1)
    world.define("h2", 1, standby=1)
    world.fleet.hosts["h2"].stop("pgc-01-s1")
    world.provisioner.broken.add("pgc-01-s1")
    supervisor, attempts = supervising(world)
    supervisor._sweep()
    [incident] = settled(supervisor, 1)
    assert (incident.guest, incident.what) == ("pgc-01-s1", "standby not running")
    assert (incident.status, incident.action) == ("reported", "none"), incident
    assert incident.message.startswith("pgc-01-s1 was created by Terraform and cannot be started again "
                                       "from its disk (pgc-01-s1 on h2 stopped while booting")
    assert "run `terraform apply` for host h2 (add -replace" in incident.message
    # Nothing of Terraform's removed, nothing built in its place.
    assert world.removed == [] and world.provisioner.built == []
    assert world.fleet.hosts["h2"].defined("pgc-01-s1")
    # Reported once: later sweeps neither record it again nor try again.
    for _ in range(3):
        supervisor._sweep()
    assert len(settled(supervisor, 1)) == 1 and attempts == [1]


def test_a_missing_terraform_standby_is_reported_once_not_built(world: World) -> None:
    world.define("h1", 1)  # h2 not applied yet
    supervisor, attempts = supervising(world)
    supervisor._sweep()
    [incident] = settled(supervisor, 1)
    assert (incident.guest, incident.what) == ("pgc-01", "standby missing")
    assert incident.status == "reported", incident
    assert "pgc-01-s1 not there" in incident.message
    assert "run `terraform apply` for host h2" in incident.message
    assert world.provisioner.built == []
    for _ in range(3):
        supervisor._sweep()
    assert len(settled(supervisor, 1)) == 1 and attempts == [1]
    assert world.provisioner.built == [] and not world.fleet.hosts["h2"].defined("pgc-01-s1")


def test_a_fault_left_to_terraform_is_forgotten_once_put_right(world: World) -> None:
    """`terraform apply -replace` made the standby whole: when it stops again (its event missed),
    the sweep has it started again rather than taking it for the fault already reported."""
    world.define("h1", 1)
    world.define("h2", 1, standby=1)
    world.fleet.hosts["h2"].stop("pgc-01-s1")
    world.provisioner.broken.add("pgc-01-s1")
    supervisor, attempts = supervising(world)
    supervisor._sweep()
    assert settled(supervisor, 1)[0].status == "reported"
    world.provisioner.broken.clear()  # terraform apply -replace ...
    world.fleet.hosts["h2"].start("pgc-01-s1")
    supervisor._sweep()
    assert attempts == [1]  # nothing wrong now
    world.fleet.hosts["h2"].stop("pgc-01-s1")
    supervisor._sweep()
    settled(supervisor, 1)
    assert attempts == [1, 1]
    assert world.state("h2", "pgc-01-s1") == "running"
    assert world.removed == [] and world.provisioner.built == []


def test_a_primary_fault_is_not_hidden_by_a_reported_missing_standby(world: World) -> None:
    """The instance's "standby missing" carries its name, pgc-01, which is its primary's too:
    once that is reported, a fault of the primary pgc-01 is still a fault of its own."""
    world.define("h1", 1)
    supervisor, attempts = supervising(world)
    supervisor._sweep()
    settled(supervisor, 1)
    world.define("h2", 1, standby=1)  # terraform apply on h2
    supervisor._sweep()
    assert attempts == [1]  # nothing wrong now
    world.fleet.hosts["h1"].stop("pgc-01")
    supervisor._sweep()
    incidents = settled(supervisor, 2)
    assert [(i.guest, i.what, i.status, i.action) for i in incidents] == [
        ("pgc-01", "standby missing", "reported", "none"),
        ("pgc-01", "primary not running", "recovered", "restart"),
    ], incidents
    assert world.state("h1", "pgc-01") == "running"
    assert attempts == [1, 1]


def test_after_a_failover_terraforms_old_primary_slot_is_left_to_terraform(world: World) -> None:
    """The old primary's guest is gone after a failover made pgc-01-s1 the primary: the manager
    does not build a standby in its slot on h1, it says which apply does."""
    world.define("h2", 1, standby=1)
    host = world.fleet.hosts["h2"]
    meta = host.guest("pgc-01-s1").metadata
    host.set_metadata("pgc-01-s1", replace(meta, role="primary", standby=0))
    result = Repairer(world.fleet, world.provisioner).repair(1, "restart")
    assert result.steps == ()
    [left] = result.left
    assert left.guest == "pgc-01" and left.action == Action.NONE
    assert "pgc-01 not there" in left.message and "run `terraform apply` for host h1" in left.message
    assert world.provisioner.built == [] and world.removed == []


# -- the manager's own instances, as before ----------------------------------------------------


def test_the_managers_standby_that_cannot_start_is_rebuilt(world: World) -> None:
    world.define("h1", 1, created_by="manager")
    world.define("h2", 1, standby=1, created_by="manager")
    world.fleet.hosts["h2"].stop("pgc-01-s1")
    world.provisioner.broken.add("pgc-01-s1")
    result = Repairer(world.fleet, world.provisioner).repair(1, "restart")
    assert [(s.guest, s.action) for s in result.steps] == [("pgc-01-s1", Action.REBUILD)]
    assert result.left == ()
    assert world.removed == ["pgc-01-s1 on h2"]
    assert world.provisioner.built == ["pgc-01-s1 on h2"]


def test_the_managers_missing_standby_is_built(world: World) -> None:
    world.define("h1", 1, created_by="manager")
    result = Repairer(world.fleet, world.provisioner).repair(1, "restart")
    assert [(s.guest, s.action) for s in result.steps] == [("pgc-01-s1", Action.REBUILD)]
    assert result.left == ()
    assert world.provisioner.built == ["pgc-01-s1 on h2"]
    assert world.state("h2", "pgc-01-s1") == "running"


# -- the event path ----------------------------------------------------------------------------


def test_a_terraform_guests_stop_event_is_a_fault(tmp_path: Path) -> None:
    """On test:///default (its events reach the supervisor's own connection)."""
    conn = reset_test_driver()
    try:
        config = FleetConfig(hosts=[HostConfig(name="h1", uri="test:///default", role="primary")],
                             replication=Replication(standbys=0),
                             recovery=RecoveryPolicy(enabled=False))
        fleet = Fleet(config, Paths(tmp_path))
        supervisor = Supervisor(fleet, sweep_s=3600)
        spec = guest_spec(1)
        conn.defineXML(replace(spec, metadata=replace(spec.metadata, created_by="terraform")).to_xml()).create()
        supervisor._on_event(GuestEvent("h1", "pgc-01", "stopped", "it was destroyed (forced off)", time.time()))
        [incident] = supervisor.incidents()
        assert (incident.guest, incident.what, incident.status) == ("pgc-01", "primary stopped", "reported")
        being_built = guest_spec(2, creating=True)
        conn.defineXML(replace(being_built, metadata=replace(being_built.metadata,
                                                             created_by="terraform")).to_xml()).create()
        supervisor._on_event(GuestEvent("h1", "pgc-02", "stopped", "it was destroyed (forced off)", time.time()))
        assert len(supervisor.incidents()) == 1  # still being created: not a fault
        fleet.close()
    finally:
        conn.close()



def test_a_stale_record_never_gets_the_real_primary_rewound(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record names pgc-01-s1 as the primary (a failover, long ago), but the guests were all
    made again: pgc-01 is the primary and pgc-01-s1 streams from it. The repair must not rejoin
    pgc-01 onto its own standby: it stops, saying why, and touches nothing."""
    from pgcarve.control.sync_record import SyncRecord

    world.define("h1", 1)
    world.define("h2", 1, standby=1)
    world.fleet.sync_records.put(SyncRecord(instance="pgc-01", primary="pgc-01-s1", primary_host="h2",
                                            members=(), synchronous=()))
    monkeypatch.setattr(world.fleet, "reach", lambda info, with_endpoint=True: Guest(
        info=info, address="10.77.0.250", endpoint=("127.0.0.1", 5432)))
    monkeypatch.setattr(Repairer, "_streams_from_another", lambda self, guest: guest.name == "pgc-01-s1")
    rejoined: list[str] = []
    monkeypatch.setattr(world.provisioner, "rejoin", lambda guest, *args, **kwargs: rejoined.append(guest.name))
    with pytest.raises(GuestNotReady, match="pgc-01-s1 streams from another server"):
        Repairer(world.fleet, world.provisioner).repair(1, "restart")
    assert rejoined == [] and world.removed == [] and world.provisioner.built == []
    assert world.state("h1", "pgc-01") == "running"


def test_standbys_without_a_guest_are_named_for_the_writes_line(world: World) -> None:
    """A primary applied before its standby host: GET /v1/instances' `writes` names the standby
    that has no guest yet and its host (Fleet.absent_standbys), and stops once it exists."""
    world.define("h1", 1)
    [inst] = world.fleet.observe()
    assert world.fleet.absent_standbys(inst) == ["pgc-01-s1 on h2"]
    world.define("h2", 1, standby=1)
    [inst] = world.fleet.observe()
    assert world.fleet.absent_standbys(inst) == []
