"""Who decides an instance's roles is recorded in each guest's metadata (control/roles_guard.py):
an instance made under another decider than the hosts file's replication.roles is observed,
marked, and left alone. Nothing repairs, retires, brings back, switches over or backs it up;
the other instances go on as before.

On libvirt's test driver. A fleet of an earlier release whose hosts file is now read as Patroni's
is played by making instances under the manager's roles, then switching the config's
replication.roles to patroni.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest
from pgcarve.backup.catalog import BackupType
from pgcarve.config import RecoveryPolicy, Replication
from pgcarve.control import roles_guard
from pgcarve.control.backups import Backups
from pgcarve.control.fleet import Fleet, no_progress
from pgcarve.control.operations import OperationQueue
from pgcarve.control.recovery import Repairer
from pgcarve.control.retired import parse_marker, retired_doc, retired_instances
from pgcarve.control.retirement import retire_instance, revive_instance
from pgcarve.control.role_changes import run_role_change
from pgcarve.control.scaler import Scaler
from pgcarve.errors import RolesMismatch
from pgcarve.virt.domain_xml import InstanceMetadata, Nic, mac_for
from pgcarve.virt.events import GuestEvent
from pgcarve.virt.host import LibvirtHost

from tests.support.domains import FLEET, TEST_URI, guest_spec, reset_test_driver
from tests.unit.simulated import one_host_fleet, scaler_of
from tests.unit.test_repair_by_creator import FakeProvisioner, World, fleet_of_hosts, settled, supervising

# -- what a guest records ------------------------------------------------------------------------


def test_a_domain_without_the_attribute_reads_as_made_under_the_managers_roles() -> None:
    xml = guest_spec(1).to_xml()
    assert ' roles="manager"' in xml, "every new guest records who decides its roles"
    earlier = xml.replace(' roles="manager"', "")
    meta = InstanceMetadata.from_domain_xml(earlier)
    assert meta is not None and meta.roles == "manager"
    conn = reset_test_driver()
    try:
        conn.defineXML(earlier).create()
        host = LibvirtHost("h0", TEST_URI)
        try:
            assert host.guest("pgc-01").metadata.roles == "manager"
        finally:
            host.close()
    finally:
        conn.close()


def test_the_attribute_round_trips_and_is_checked() -> None:
    meta = InstanceMetadata(fleet="pgc", cluster="pgc-01", role="primary", index=1, roles="patroni")
    assert InstanceMetadata.from_element(meta.element()) == meta
    with pytest.raises(Exception, match="roles 'someone' must be manager or patroni"):
        InstanceMetadata(fleet="pgc", cluster="pgc-01", role="primary", index=1, roles="someone")  # type: ignore[arg-type]


def test_a_retirement_marker_records_the_roles_and_an_earlier_ones_reads_as_the_managers() -> None:
    earlier = parse_marker("pgc-02.retired.2.primary.1795486247.ee4fc1821129", "h1")
    assert earlier is not None and earlier.roles is None and earlier.decided_by == "manager"
    assert earlier.marker == "pgc-02.retired.2.primary.1795486247.ee4fc1821129", "its volume is found again"
    assert earlier.metadata("pgc").roles == "manager"
    now = parse_marker("pgc-02-s1.retired.2.standby1.1795486247..patroni", "h2")
    assert now is not None and (now.roles, now.image_tag, now.standby) == ("patroni", "", 1)
    assert now.marker == "pgc-02-s1.retired.2.standby1.1795486247..patroni"
    assert now.metadata("pgc").roles == "patroni"


def test_the_message_names_both_deciders_and_what_to_do() -> None:
    assert roles_guard.mismatch("pgc-01", [("pgc-01", "patroni")], "patroni") is None
    message = roles_guard.mismatch("pgc-01", [("pgc-01", "manager"), ("pgc-01-s1", "manager")], "patroni")
    assert message is not None
    assert message.startswith("pgc-01 was made under the manager's roles (no Patroni in its guests) but this "
                              "fleet's hosts file says Patroni decides roles")
    assert "pgcarve does not act on it" in message
    assert "Set replication.roles: manager in the hosts file to keep running it as it is" in message
    assert "moving an instance to Patroni is not built yet" in message
    reverse = roles_guard.mismatch("pgc-01", [("pgc-01", "patroni"), ("pgc-01-s1", "manager")], "manager")
    assert reverse is not None and reverse.startswith("pgc-01 (its guests pgc-01) was made under Patroni's roles")
    assert "Set replication.roles: patroni" in reverse


# -- an earlier release's fleet read as Patroni's: scale, bring back, switchover, backup -----------


@pytest.fixture
def earlier(tmp_path: Path) -> Iterator[tuple[Fleet, Scaler]]:
    """Two instances made under the manager's roles, one retired; the hosts file then read as
    Patroni's (an etcd section, no roles line)."""
    fleet = one_host_fleet(tmp_path)
    scaler = scaler_of(fleet)
    scaler.scale(3)
    scaler.scale(2)
    fleet.config.replication.roles = "patroni"
    yield fleet, scaler
    fleet.close()


def test_instances_made_under_the_managers_roles_are_marked_in_a_patroni_fleet(
        earlier: tuple[Fleet, Scaler]) -> None:
    fleet, _ = earlier
    instances = fleet.observe(with_endpoints=False)
    assert [i.name for i in instances] == ["pgcbench-01", "pgcbench-02"]
    for inst in instances:
        assert inst.roles_mismatch is not None
        assert inst.roles_mismatch.startswith(f"{inst.name} was made under the manager's roles")
        assert inst.primary is not None and inst.primary.name == inst.name, "shown as its metadata says"
    [retired] = retired_instances(fleet)
    assert retired.roles_mismatch is not None and retired.roles_mismatch.startswith("pgcbench-03 was made under")
    assert retired_doc(retired)["incident"] == retired.roles_mismatch


def test_scale_down_and_bring_back_are_refused_and_change_nothing(earlier: tuple[Fleet, Scaler]) -> None:
    fleet, scaler = earlier
    before = ({g.name: g.state for g in fleet.guests()}, fleet.hosts["db1"].storage.volume_names())
    with pytest.raises(RolesMismatch, match="pgcbench-02 was made under the manager's roles"):
        scaler.scale(1)
    with pytest.raises(RolesMismatch, match="pgcbench-03 was made under the manager's roles"):
        scaler.scale(3)
    inst = fleet.instance("pgcbench-02")
    with pytest.raises(RolesMismatch):
        retire_instance(fleet, inst)
    with pytest.raises(RolesMismatch):
        revive_instance(scaler.provisioner, retired_instances(fleet)[0])
    assert ({g.name: g.state for g in fleet.guests()}, fleet.hosts["db1"].storage.volume_names()) == before


def test_switchover_failover_and_backup_are_refused(earlier: tuple[Fleet, Scaler], tmp_path: Path) -> None:
    fleet, scaler = earlier
    inst = fleet.instance("pgcbench-01")
    for kind in ("switchover", "failover"):
        with pytest.raises(RolesMismatch, match="pgcarve does not act on it"):
            run_role_change(fleet, scaler.provisioner, inst, kind, None, False, no_progress)
    backups = Backups(fleet, OperationQueue(lambda op: None))
    with pytest.raises(RolesMismatch):
        backups.take(inst, BackupType.FULL, lambda step, fraction: None)


def test_scale_up_of_other_instances_still_works(tmp_path: Path) -> None:
    """A manager's fleet in which pgcbench-01 and -02 were made under Patroni: -03 is made, under
    the fleet's roles, beside them."""
    fleet = one_host_fleet(tmp_path)
    try:
        scaler = scaler_of(fleet)
        scaler.scale(2)
        for guest in fleet.guests():
            fleet.hosts[guest.host].set_metadata(guest.name, replace(guest.metadata, roles="patroni"))
        assert all(i.roles_mismatch for i in fleet.observe(with_endpoints=False))
        plan = scaler.scale(3)
        assert plan.create == (3,) and plan.retire == () and plan.revive == ()
        made = fleet.instance("pgcbench-03", with_endpoints=False)
        assert made.roles_mismatch is None
        assert {g.info.metadata.roles for g in made.guests} == {"manager"}, "new guests record the fleet's roles"
        with pytest.raises(RolesMismatch, match="pgcbench-02 was made under Patroni's roles"):
            scaler.scale(1)  # retiring -03 would be fine, -02 is not: nothing is retired
        assert [i.name for i in fleet.observe(with_endpoints=False)] == ["pgcbench-01", "pgcbench-02", "pgcbench-03"]
    finally:
        fleet.close()


# -- the HA loop ------------------------------------------------------------------------------------


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    fleet, removed = fleet_of_hosts(tmp_path, monkeypatch, 1, Replication(standbys=1, sync_count=1),
                                    RecoveryPolicy(primary="restart"))
    yield World(fleet, FakeProvisioner(fleet), removed)
    fleet.close()


def define(w: World, host: str, index: int, roles: Literal["manager", "patroni"] | None,
           standby: int = 0) -> str:
    """A guest of the manager's, made under `roles` (None: by an earlier release, no attribute)."""
    spec = guest_spec(index, standby=standby)
    spec = replace(spec, metadata=replace(spec.metadata, created_by="manager", roles=roles or "manager"),
                   nics=(Nic("pgcarve", mac_for(FLEET, spec.name)),))
    xml = spec.to_xml() if roles else spec.to_xml().replace(' roles="manager"', "")
    lv = w.fleet.hosts[host]
    lv.conn.defineXML(xml).create()
    return spec.name


def test_the_ha_loop_leaves_a_mismatched_instance_alone_and_repairs_the_others(
        world: World, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager's fleet (no etcd) with pgc-01 made under Patroni: its stopped primary is not
    started again (nor a standby promoted behind Patroni's back), said once; pgc-02's is."""
    monkeypatch.setattr(roles_guard, "_said", set())
    for index, roles in ((1, "patroni"), (2, None)):
        define(world, "h1", index, roles)  # type: ignore[arg-type]
        define(world, "h2", index, roles, standby=1)  # type: ignore[arg-type]
        world.fleet.hosts["h1"].stop(f"pgc-0{index}")
    supervisor, attempts = supervising(world)
    with caplog.at_level(logging.WARNING, logger="pgcarve.control.roles_guard"):
        supervisor._sweep()
        settled(supervisor, 1)
        # Later sweeps, once pgc-02's repair is done (one still running would see it stopped and
        # count it again), and an event: pgc-01 is still observed and left alone.
        for _ in range(2):
            supervisor._sweep()
        supervisor._on_event(GuestEvent("h1", "pgc-01", "stopped", "shut down", 0.0))
        [incident] = settled(supervisor, 1)
    assert (incident.instance, incident.guest, incident.status, incident.action) == (
        "pgc-02", "pgc-02", "recovered", "restart")
    assert attempts == [2]
    assert world.state("h1", "pgc-02") == "running"
    assert world.state("h1", "pgc-01") == "shut-off", "left alone"
    said = [r.getMessage() for r in caplog.records if r.name == "pgcarve.control.roles_guard"]
    assert said == [world.fleet.instance("pgc-01").roles_mismatch], "said once, not every sweep"
    assert said[0].startswith("pgc-01 was made under Patroni's roles")
    # The repairer refuses it too, if asked.
    with pytest.raises(RolesMismatch):
        Repairer(world.fleet, world.provisioner).repair(1, "restart")
    assert world.state("h1", "pgc-01") == "shut-off"


def test_an_earlier_releases_instance_matches_a_managers_fleet(world: World) -> None:
    define(world, "h1", 1, None)
    define(world, "h2", 1, None, standby=1)
    world.fleet.hosts["h1"].stop("pgc-01")
    assert world.fleet.instance("pgc-01").roles_mismatch is None
    supervisor, attempts = supervising(world)
    supervisor._sweep()
    [incident] = settled(supervisor, 1)
    assert (incident.status, incident.action) == ("recovered", "restart") and attempts == [1]
    assert world.state("h1", "pgc-01") == "running"
