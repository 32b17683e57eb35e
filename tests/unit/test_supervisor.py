"""The HA loop's decisions on libvirt's test driver: which lifecycle events are faults, and that
half-made instances are removed after a manager crash. (Repairs that boot guests are in
tests/integration/test_faults.py.)"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import libvirt
import pytest
from pgcarve.config import FleetConfig, HostConfig, RecoveryPolicy, Replication
from pgcarve.control.fleet import Fleet, Progress, no_progress
from pgcarve.control.recovery import Action, RepairIncomplete, RepairResult, RepairStep
from pgcarve.control.removal import discard_half_made, discard_instance
from pgcarve.control.supervisor import Incident, Supervisor, repair_progress
from pgcarve.errors import GuestNotReady, PgcarveError
from pgcarve.postgres.replication import lsn_value
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import InstanceMetadata, Role

from tests.support.domains import define, reset_test_driver

URI = "test:///default"


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[libvirt.virConnect, Fleet, Supervisor]]:
    conn = reset_test_driver()
    config = FleetConfig(hosts=[HostConfig(name="h1", uri=URI, role="primary")],
                         replication=Replication(standbys=0),
                         recovery=RecoveryPolicy(primary="restart", enabled=False))
    fleet = Fleet(config, Paths(tmp_path))
    supervisor = Supervisor(fleet, sweep_s=3600)
    supervisor.start()
    assert supervisor.wait_connected(10), "no lifecycle event connection to the test driver"
    deadline = time.monotonic() + 10
    while not supervisor.ready():  # the start-up sweep must not race the faults made below
        assert time.monotonic() < deadline, "the supervisor did not finish its start-up sweep"
        time.sleep(0.01)
    yield conn, fleet, supervisor
    supervisor.stop()
    fleet.close()
    conn.close()


def wait_incidents(supervisor: Supervisor, count: int, timeout_s: float = 120) -> list[Incident]:
    """At least `count` incidents, each handled (an incident is recorded first, then decided on).
    Returns as soon as they are there; the long bound is for make test's local lane, which runs
    at a low CPU priority beside booting guests (30 s was missed there twice)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = supervisor.incidents()
        if len(found) >= count and all(i.finished_at is not None for i in found):
            return found
        time.sleep(0.02)
    return supervisor.incidents()


def test_a_destroyed_primary_is_an_incident_from_its_event(world: tuple[libvirt.virConnect, Fleet, Supervisor]) -> None:
    conn, _fleet, supervisor = world
    define(conn, 1)
    destroyed_at = time.time()
    conn.lookupByName("pgc-01").destroy()
    incidents = wait_incidents(supervisor, 1)
    assert len(incidents) == 1
    incident = incidents[0]
    assert (incident.guest, incident.role, incident.what, incident.source) == ("pgc-01", "primary",
                                                                               "primary stopped", "event")
    assert "destroyed" in incident.cause
    # From the event, not the sweep (every 3600 s here); how fast is for the benchmarks to report.
    assert destroyed_at <= incident.detected_at
    # recovery.enabled: false -> reported, nothing touched
    assert incident.status == "reported" and incident.action == "none"
    assert conn.lookupByName("pgc-01").isActive() == 0


def test_guests_being_built_or_removed_on_purpose_are_not_faults(
        world: tuple[libvirt.virConnect, Fleet, Supervisor]) -> None:
    conn, fleet, supervisor = world
    define(conn, 1, creating=True)  # a scale operation is still building it
    define(conn, 2)
    conn.lookupByName("pgc-01").destroy()
    discard_instance(fleet, 2)  # the manager's own removal
    define(conn, 3)
    conn.lookupByName("pgc-03").destroy()  # a real fault, as a marker that events were processed
    incidents = wait_incidents(supervisor, 1)
    assert [i.guest for i in incidents] == ["pgc-03"], (
        f"{supervisor.events_seen} lifecycle event(s) reached the supervisor; its loop is "
        f"{'alive' if supervisor._thread.is_alive() else 'dead'}")


def test_half_made_instances_are_removed_on_restart(tmp_path: Path) -> None:
    conn = reset_test_driver((1,))
    try:
        define(conn, 2, creating=True)
        fleet = Fleet(FleetConfig(hosts=[HostConfig(name="h1", uri=URI, role="primary")],
                                  replication=Replication(standbys=0)), Paths(tmp_path))
        removed = discard_half_made(fleet)
        assert removed == ["half-made instance pgc-02 (pgc-02)"]
        assert [g.name for g in fleet.guests()] == ["pgc-01"]
        fleet.hosts["h1"].mark_complete("pgc-01")
        assert not fleet.hosts["h1"].guest("pgc-01").creating
        fleet.close()
    finally:
        conn.close()


def test_a_half_built_standby_never_takes_its_instance_with_it(tmp_path: Path) -> None:
    """A manager killed while rebuilding a standby (or while marking a new instance complete)
    leaves an instance that holds data: only the unfinished standby goes."""
    conn = reset_test_driver((1, 2))
    try:
        define(conn, 1, standby=1, creating=True)  # being rebuilt for a whole instance
        define(conn, 1, standby=2)
        define(conn, 2, standby=1)  # pgc-02: its standby was marked complete, then the manager died
        conn.lookupByName("pgc-02").destroy()
        conn.lookupByName("pgc-02").undefine()
        define(conn, 2, creating=True)  # before it marked the primary
        fleet = Fleet(FleetConfig(hosts=[HostConfig(name="h1", uri=URI, role="primary")],
                                  replication=Replication(standbys=0)), Paths(tmp_path))
        removed = discard_half_made(fleet)
        assert removed == ["half-built standby pgc-01-s1 of pgc-01 on h1 "
                           "(the instance keeps its data; the standby is built again)"]
        guests = {g.name: g for g in fleet.guests()}
        assert sorted(guests) == ["pgc-01", "pgc-01-s2", "pgc-02", "pgc-02-s1"]
        assert not any(g.creating for g in guests.values())
        fleet.close()
    finally:
        conn.close()


def test_a_promoted_standby_gets_its_new_identity_in_libvirt(tmp_path: Path) -> None:
    """Failover rewrites the guest's metadata (role, standby number) in place; both the live and
    the persistent definition carry it, and the title follows."""
    conn = reset_test_driver((1,))
    try:
        fleet = Fleet(FleetConfig(hosts=[HostConfig(name="h1", uri=URI, role="primary")],
                                  replication=Replication(standbys=0)), Paths(tmp_path))
        host = fleet.hosts["h1"]
        before = host.guest("pgc-01").metadata
        changes: tuple[tuple[Role, int], ...] = (("standby", 2), ("primary", 0))
        for role, number in changes:
            host.set_metadata("pgc-01", replace(before, role=role, standby=number))
            assert host.guest("pgc-01").metadata == replace(before, role=role, standby=number)
            dom = conn.lookupByName("pgc-01")
            for flags in (0, libvirt.VIR_DOMAIN_XML_INACTIVE):
                assert InstanceMetadata.from_domain_xml(dom.XMLDesc(flags)) == replace(before, role=role,
                                                                                        standby=number)
            assert dom.metadata(libvirt.VIR_DOMAIN_METADATA_TITLE, None, 0) == f"pgcarve {role} pgc-01"
        fleet.close()
    finally:
        conn.close()


def test_lsn_order() -> None:
    assert lsn_value("0/0") < lsn_value("0/16B3748") < lsn_value("1/0") < lsn_value("16/B374D848")
    assert lsn_value(None) == -1


@contextlib.contextmanager
def failing_once(tmp_path: Path, policy: str, failure: PgcarveError,
                 retry_s: float = 0.1) -> Iterator[tuple[Supervisor, list[int]]]:
    """A supervisor over running pgc-01 that sweeps every few milliseconds and retries after
    `retry_s`, whose repairs raise `failure` the first time and find nothing to do after that;
    and the list of repair attempts (instance indexes)."""
    conn = reset_test_driver()
    config = FleetConfig(hosts=[HostConfig(name="h1", uri=URI, role="primary")],
                         replication=Replication(standbys=0), recovery=RecoveryPolicy(primary=policy))
    fleet = Fleet(config, Paths(tmp_path))
    define(conn, 1)
    supervisor = Supervisor(fleet, sweep_s=0.05, retry_s=retry_s)
    attempts: list[int] = []

    def repair(index: int, policy: str, host_lost: bool = False, isolated: bool = False,
               progress: Progress = no_progress) -> RepairResult:
        attempts.append(index)
        if len(attempts) == 1:
            raise failure
        return RepairResult()

    supervisor.repairer.repair = repair  # type: ignore[method-assign]
    try:
        supervisor.start()
        yield supervisor, attempts
    finally:
        supervisor.stop()
        fleet.close()
        conn.close()


def wait_recovered(incident: Incident, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while incident.status != "recovered":
        assert time.monotonic() < deadline, f"not recovered: {incident}"
        if incident.status == "failed" and incident.action == "failover":
            assert "then failed: forward" in (incident.message or ""), incident
        time.sleep(0.01)


def test_a_failed_repair_is_tried_again_when_the_sweep_sees_nothing_wrong(tmp_path: Path) -> None:
    """A repair that failed (a standby running but not streaming, which the sweep cannot see
    from libvirt) is attempted again after retry_s, and its incident ends recovered."""
    failure = GuestNotReady("standbys of pgc-01 (pgc_01_s1) are not streaming after 300 s")
    with failing_once(tmp_path, "restart", failure) as (supervisor, attempts):
        incident = supervisor._record(1, "pgc-01-s1", "h1", "standby", "standby not streaming", "test",
                                      time.time(), "event")
        supervisor._schedule(1, [incident])
        wait_recovered(incident)
    assert attempts == [1, 1]


def test_a_failed_repair_is_tried_again_at_once_when_a_lost_host_answers_again(tmp_path: Path) -> None:
    """A repair that failed waits retry_s (an hour here) before it is tried again, unless a host
    that did not answer answers again: what it failed on may be gone, so it is tried at once."""
    failure = GuestNotReady("pgc-01 is 1 standby(s) short of 2: no host of its placement answers (h2 not answering)")
    with failing_once(tmp_path, "restart", failure, retry_s=3600) as (supervisor, attempts):
        incident = supervisor._record(1, "pgc-01-s1", "h1", "standby", "standby missing", "test", time.time(), "event")
        supervisor._schedule(1, [incident])
        deadline = time.monotonic() + 10
        while incident.status != "failed":
            assert time.monotonic() < deadline, incident
            time.sleep(0.01)
        time.sleep(0.5)  # ten sweeps: none of them retries within the hour
        assert attempts == [1]
        # The host was lost at the last listing and answers at this one (the fleet notices it
        # while listing guests, as the service's refresh does every 2 s).
        supervisor.fleet._unreachable["h1"] = (time.time() - 60, "test: it did not answer")
        supervisor.fleet.guests()
        wait_recovered(incident)
    assert attempts == [1, 1]


def test_a_failover_that_failed_half_way_is_still_reported_as_a_failover(tmp_path: Path) -> None:
    """The first attempt promotes a standby, then fails building the replacement; the retry finds
    nothing left to do. The incident ends recovered, says it failed over, and keeps why the first
    attempt stopped."""
    promoted = RepairStep("pgc-01", Action.FAILOVER, "failed over from pgc-01 to pgc-01-s1 on h2")
    failure = RepairIncomplete(GuestNotReady("forward for pgc-01 did not start in 30 s"), (promoted,))
    with failing_once(tmp_path, "failover", failure) as (supervisor, attempts):
        incident = supervisor._record(1, "pgc-01", "h1", "primary", "primary stopped", "test", time.time(), "event")
        supervisor._schedule(1, [incident])
        wait_recovered(incident)
    assert incident.action == "failover", incident
    assert (incident.message or "").startswith("failed over from pgc-01 to pgc-01-s1"), incident
    assert attempts == [1, 1]


def test_repair_steps_are_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    progress = repair_progress(3)
    with caplog.at_level("INFO", logger="pgcarve.control.supervisor"):
        for _ in range(3):  # a wait reports the same step twice a second
            progress("pgc-03", "waiting for standbys to stream", 0.9)
        progress("pgc-03-s1", "starting again from its disk on h1", 0.2)
        progress("pgc-03", "waiting for standbys to stream", 0.9)
    assert [r.getMessage() for r in caplog.records] == [
        "instance 3: pgc-03: waiting for standbys to stream",
        "instance 3: pgc-03-s1: starting again from its disk on h1",
    ]
