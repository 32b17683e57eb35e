"""Scale-down retires, scale-up brings back, only purge deletes (issue 14), on libvirt's test
driver: the real Fleet, Scaler, Provisioner, retirement and API; no guest boots, so the instances
have no standbys (the write fence and catch-up need PostgreSQL: tests/integration/test_retire.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from fastapi.testclient import TestClient
from pgcarve.config import HostConfig
from pgcarve.control import retirement
from pgcarve.control.fleet import Fleet, Guest, Progress
from pgcarve.control.patroni_roles import PatroniClusters
from pgcarve.control.removal import discard_half_made, leftovers
from pgcarve.control.retired import parse_marker, retired_instances
from pgcarve.control.retirement import finish_interrupted, purge
from pgcarve.control.scaler import Scaler
from pgcarve.control.service import ManagerService
from pgcarve.errors import CapacityError, Conflict, GuestNotReady, NotFound, PgcarveError
from pgcarve.settings import Paths

from tests.support import testdriver as td
from tests.support.api import app_for
from tests.unit.simulated import one_host_fleet, scaler_of

TOKEN = "retirement-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class World:
    fleet: Fleet
    scaler: Scaler
    paths: Paths

    def pins(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        return {g.name: g.vcpu_pins for g in self.fleet.guests()}

    def volumes(self) -> set[str]:
        return self.fleet.hosts["db1"].storage.volume_names()


def _world(tmp_path: Path) -> World:
    fleet = one_host_fleet(tmp_path)
    return World(fleet, scaler_of(fleet), fleet.paths)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """One test-driver host (a test:///FILE connection is a host of its own, state and all)."""
    w = _world(tmp_path)
    yield w
    w.fleet.close()


def test_markers_name_what_a_retired_guest_was() -> None:
    guest = parse_marker("pgc-02-s1.retired.2.primary.1795486247.ee4fc1821129", "h1")
    assert guest is not None and (guest.name, guest.index, guest.role, guest.standby) == ("pgc-02-s1", 2, "primary", 0)
    assert guest.marker == "pgc-02-s1.retired.2.primary.1795486247.ee4fc1821129"
    standby = parse_marker("pgc-02.retired.2.standby1.1795486247.", "h0")
    assert standby is not None and (standby.role, standby.standby, standby.image_tag) == ("standby", 1, "")
    for other in ("pgc-02.qcow2", "pgc-02-seed.iso", "pgc-02.retired.2.leader.1.x", "pgc-02.retired.x.primary.1.a"):
        assert parse_marker(other, "h0") is None


def test_scale_down_retires_and_scale_up_brings_the_same_instances_back(world: World) -> None:
    world.scaler.scale(3)
    pins_before = world.pins()
    plan = world.scaler.scale(1)
    assert plan.retire == (3, 2) and plan.create == () and plan.revive == ()
    assert [i.name for i in world.fleet.observe()] == ["pgcbench-01"]  # their CPUs are free
    retired = retired_instances(world.fleet)
    assert [r.name for r in retired] == ["pgcbench-02", "pgcbench-03"]
    assert all(r.disk_mib > 0 and r.retired_at > 0 for r in retired)
    for name in ("pgcbench-02", "pgcbench-03"):
        assert {f"{name}.qcow2", f"{name}-seed.iso"} <= world.volumes(), "retired disks are kept"

    plan = world.scaler.scale(2)
    assert plan.revive == (2,) and plan.create == ()
    assert [i.name for i in world.fleet.observe()] == ["pgcbench-01", "pgcbench-02"]
    assert world.pins()["pgcbench-02"] == pins_before["pgcbench-02"], "it comes back in its own slot"
    assert [r.name for r in retired_instances(world.fleet)] == ["pgcbench-03"]
    assert not [v for v in world.volumes() if v.startswith("pgcbench-02.retired.")], "its marker is gone"

    # Slots with nothing retired are new; retired ones come back first.
    plan = world.scaler.scale(4)
    assert plan.revive == (3,) and plan.create == (4,)
    assert retired_instances(world.fleet) == []


def test_a_host_that_cannot_list_its_retired_disks_is_said_once_per_outage(
        world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    world.scaler.scale(2)
    world.scaler.scale(1)
    storage = world.fleet.hosts["db1"].storage

    def lost() -> set[str]:
        raise PgcarveError("host db1: cannot reach libvirt")

    monkeypatch.setattr(storage, "volume_names", lost)
    with caplog.at_level("INFO", logger="pgcarve.control.retired"):
        for _ in range(3):  # the API and the HA loop read every few seconds while a host is lost
            assert retired_instances(world.fleet) == [], "a host that does not answer lists nothing"
        monkeypatch.undo()
        assert [r.name for r in retired_instances(world.fleet)] == ["pgcbench-02"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "cannot list retired disks" in said[0], said
    assert "listed again" in said[1], said


def test_purge_deletes_only_a_retired_instance_and_only_by_name(world: World) -> None:
    world.scaler.scale(2)
    world.scaler.scale(1)
    with pytest.raises(Conflict, match="pgcbench-01 is not retired"):
        purge(world.fleet, "pgcbench-01")
    with pytest.raises(NotFound, match="no retired instance named 'pgcbench-07'"):
        purge(world.fleet, "pgcbench-07")
    gone = purge(world.fleet, "pgcbench-02")
    assert gone.name == "pgcbench-02" and gone.disk_mib > 0
    assert not [v for v in world.volumes() if v.startswith("pgcbench-02")]
    assert retired_instances(world.fleet) == []
    assert [g.name for g in world.fleet.guests()] == ["pgcbench-01"]
    # With nothing retired, its slot gets a new database.
    assert world.scaler.scale(2).create == (2,)


def test_a_refused_scale_up_names_the_retired_disks_in_the_way(world: World) -> None:
    world.scaler.scale(3)
    world.scaler.scale(1)
    # Now a reserve its pool (100 GiB on the test driver) cannot give.
    config = world.fleet.config
    world.fleet.config = config.model_copy(update={"instance": config.instance.model_copy(
        update={"disk_reserve_mib": 200 * 1024})})
    with pytest.raises(CapacityError) as refused:
        world.scaler.scale(2)
    message = str(refused.value)
    assert "host db1: storage pool pgcarve" in message and "1 guest(s) to start need 204800 MiB" in message
    assert "retired instances keep their disks there: pgcbench-03 (" in message
    assert "pgcbench-02 (" not in message, "the instance coming back is not in the way"
    assert [i.name for i in world.fleet.observe()] == ["pgcbench-01"], "a refused scale changes nothing"
    assert [r.name for r in retired_instances(world.fleet)] == ["pgcbench-02", "pgcbench-03"]


def test_a_revival_cut_short_is_retired_again_and_orphans_with_data_stay(world: World) -> None:
    world.scaler.scale(2)
    world.scaler.scale(1)
    [retired] = retired_instances(world.fleet)
    # A manager killed after it started pgcbench-02 again, before it dropped the marker:
    guest = retired.guests[0]
    world.scaler.provisioner.boot_kept_disk(guest.host, guest.name, guest.metadata("pgcbench"), guest.image_tag)
    assert finish_interrupted(world.fleet) == ["pgcbench-02: finished retiring pgcbench-02 (disks kept)"]
    assert [g.name for g in world.fleet.guests()] == ["pgcbench-01"]
    assert [r.name for r in retired_instances(world.fleet)] == ["pgcbench-02"]

    storage = world.fleet.hosts["db1"].storage
    assert isinstance(storage, td.TestDriverStorage)
    storage.create_empty("pgcbench-08.qcow2", 1 << 20, "qcow2")  # never booted: a killed scale-up's
    storage.create_empty("pgcbench-09.qcow2", 64 << 20, "qcow2")  # holds data; its guest undefined by hand
    removed = discard_half_made(world.fleet)
    assert removed == ["volume pgcbench-08.qcow2 on db1 (no guest uses it)"]
    assert {"pgcbench-02.qcow2", "pgcbench-02-seed.iso", "pgcbench-09.qcow2"} <= world.volumes()
    assert "volume pgcbench-02.qcow2 on db1" in leftovers(world.fleet)


def test_the_api_lists_retired_instances_and_purges_only_when_confirmed(world: World) -> None:
    world.scaler.scale(2)
    world.scaler.scale(1)
    service = ManagerService(world.fleet.config, world.paths, collect=False, supervise=False)
    service.fleet, service.scaler = world.fleet, world.scaler
    service.refresh()
    with TestClient(app_for(service, token=TOKEN), base_url="http://127.0.0.1:8080") as client:
        assert [d["name"] for d in client.get("/v1/instances").json()] == ["pgcbench-01"]
        docs = client.get("/v1/instances", params={"include": "retired"}).json()
        assert [(d["name"], d["state"]) for d in docs] == [("pgcbench-01", "running"), ("pgcbench-02", "retired")]
        assert docs[1]["dsn"] is None and docs[1]["disk_mib"] > 0 and "pgcarve purge pgcbench-02" in docs[1]["writes"]
        assert client.get("/v1/instances/pgcbench-02").json()["state"] == "retired"
        assert client.get("/v1/instances", params={"include": "everything"}).status_code == 422

        refused = client.delete("/v1/instances/pgcbench-02", headers=AUTH)
        assert refused.status_code == 422 and "?confirm=pgcbench-02" in refused.json()["detail"]
        wrong = client.delete("/v1/instances/pgcbench-02", params={"confirm": "pgcbench-01"}, headers=AUTH)
        assert wrong.status_code == 422
        running = client.delete("/v1/instances/pgcbench-01", params={"confirm": "pgcbench-01"}, headers=AUTH)
        assert running.status_code == 409 and "scale down first" in running.json()["detail"]
        assert [r.name for r in retired_instances(world.fleet)] == ["pgcbench-02"], "refusals changed nothing"

        done = client.delete("/v1/instances/pgcbench-02", params={"confirm": "pgcbench-02"}, headers=AUTH)
        assert done.status_code == 200, done.text
        assert done.json()["name"] == "pgcbench-02" and done.json()["purged_mib"] > 0
        docs = client.get("/v1/instances", params={"include": "retired"}).json()
        assert [d["name"] for d in docs] == ["pgcbench-01"]
    service.operations.stop()


# -- under Patroni (replication.roles: patroni) -------------------------------------------------

class StandInPatroni:
    """Patroni's keys as the manager reads them: who leads each instance, and which instances'
    keys were removed."""

    def __init__(self) -> None:
        self.leaders: dict[str, str] = {}
        self.forgotten: list[str] = []
        self.error: str | None = None

    def leader(self, instance: str, fresh: bool = False) -> str | None:
        return self.leaders.get(instance)

    def forget(self, instance: str) -> None:
        self.forgotten.append(instance)


def _under_patroni(world: World, monkeypatch: pytest.MonkeyPatch) -> tuple[StandInPatroni, list[str]]:
    """The world's instances now led by Patroni (each by the guest it was made with); the names
    of the guests whose write fence was lifted are collected in the list returned."""
    patroni = StandInPatroni()
    for inst in world.fleet.observe():
        patroni.leaders[inst.name] = inst.name
    world.fleet.patroni = cast(PatroniClusters, patroni)
    lifted: list[str] = []
    monkeypatch.setattr(retirement, "_allow_writes", lambda _fleet, guest: lifted.append(guest.name))
    return patroni, lifted


def test_under_patroni_retiring_keeps_the_keys_and_bringing_back_lets_patroni_lead(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.scaler.scale(2)
    patroni, lifted = _under_patroni(world, monkeypatch)
    assert world.scaler.scale(1).retire == (2,)
    assert [r.name for r in retired_instances(world.fleet)] == ["pgcbench-02"]
    assert patroni.forgotten == [], "a retired instance's keys say who may lead when it comes back"

    del patroni.leaders["pgcbench-02"]  # its leader key expired while it was retired
    booted: list[str] = []
    ready = world.scaler.provisioner.ready

    def elected_once_booted(host: HostConfig, name: str, progress: Progress, standby: bool | None) -> Guest:
        assert standby is None, "under Patroni a member boots into whichever role Patroni gives it"
        booted.append(name)
        patroni.leaders["pgcbench-02"] = name
        return ready(host, name, progress, standby)

    monkeypatch.setattr(world.scaler.provisioner, "ready", elected_once_booted)
    assert world.scaler.scale(2).revive == (2,)
    assert booted == ["pgcbench-02"] and lifted == ["pgcbench-02"], "the fence is lifted on the leader"
    assert [i.name for i in world.fleet.observe()] == ["pgcbench-01", "pgcbench-02"]
    assert world.fleet.instance("pgcbench-02").primary is not None
    assert not [v for v in world.volumes() if ".retired." in v], "its markers are gone once it leads"


def test_under_patroni_an_instance_without_a_leader_is_not_retired(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.scaler.scale(2)
    patroni, _ = _under_patroni(world, monkeypatch)
    del patroni.leaders["pgcbench-02"]
    patroni.error = "no etcd endpoint answered"
    with pytest.raises(GuestNotReady, match=r"pgcbench-02 has no leader now \(etcd cannot be read: no etcd endpoint"):
        world.scaler.scale(1)
    assert [i.name for i in world.fleet.observe()] == ["pgcbench-01", "pgcbench-02"], "nothing was changed"
    assert retired_instances(world.fleet) == []


def test_under_patroni_purge_removes_the_keys_too(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.scaler.scale(2)
    patroni, _ = _under_patroni(world, monkeypatch)
    world.scaler.scale(1)
    purge(world.fleet, "pgcbench-02")
    assert patroni.forgotten == ["pgcbench-02"]
    assert not [v for v in world.volumes() if v.startswith("pgcbench-02")]
