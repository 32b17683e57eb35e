"""Under Patroni the manager repairs machines: a member on a host lost for host_timeout_s is
built again on a host that holds none of its instance's guests; when the lost host is back, its
guest is removed (never started) once the replacement streams.

On libvirt's test driver: four hosts (h1 primary; h2, h3, h4 standby hosts), instance 1 placed on
h1, h2 and h3, so h4 is its spare. Patroni's keys are a stand-in that says who leads and which
replicas stream. No guest boots (tests/unit/test_repair_by_creator.py's provisioner)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import pytest
from pgcarve.config import RecoveryPolicy, Replication
from pgcarve.control import recovery
from pgcarve.control.fleet import Fleet
from pgcarve.control.patroni_roles import PatroniClusters
from pgcarve.control.recovery import Action, Repairer
from pgcarve.errors import CapacityError
from pgcarve.virt.domain_xml import Nic, mac_for

from tests.support.domains import FLEET, guest_spec
from tests.unit.test_repair_by_creator import FakeProvisioner, fleet_of_hosts


@dataclass(frozen=True)
class Member:
    name: str
    replication_state: str | None


@dataclass
class Keys:
    """Patroni's keys of instance 1 as the stand-in holds them: the leader and the replicas that
    stream (member names, as Patroni writes them)."""

    leader: str | None = "pgc_01"
    streaming: set[str] = field(default_factory=set)

    @property
    def members(self) -> tuple[Member, ...]:
        return tuple(Member(n, "streaming") for n in sorted(self.streaming))


class StandInPatroni:
    def __init__(self, keys: Keys):
        self.keys = keys
        self.error: str | None = None

    def leader(self, instance: str, fresh: bool = False) -> str | None:
        return self.keys.leader.replace("_", "-") if self.keys.leader else None

    def view(self, instance: str, fresh: bool = False) -> Keys:
        return self.keys


@dataclass
class World:
    fleet: Fleet
    repairer: Repairer
    provisioner: FakeProvisioner
    keys: Keys
    lost: dict[str, tuple[float, str]]
    removed: list[str]

    def names(self) -> dict[str, str]:
        return {g.name: g.host for g in self.fleet.guests()}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    fleet, removed = fleet_of_hosts(tmp_path, monkeypatch, 3, Replication(standbys=2, sync_count=1),
                                    RecoveryPolicy(primary="restart", host_timeout_s=30))
    keys = Keys(streaming={"pgc_01_s1", "pgc_01_s2"})
    fleet.patroni = cast(PatroniClusters, StandInPatroni(keys))
    lost: dict[str, tuple[float, str]] = {}
    monkeypatch.setattr(fleet, "unreachable_hosts", lambda: dict(lost))
    for host, standby in (("h1", 0), ("h2", 1), ("h3", 2)):
        spec = guest_spec(1, standby=standby)
        fleet.hosts[host].define_and_start(replace(spec, nics=(Nic("pgcarve", mac_for(FLEET, spec.name)),)))
    provisioner = FakeProvisioner(fleet)
    yield World(fleet, Repairer(fleet, provisioner), provisioner, keys, lost, removed)
    fleet.close()


def test_a_lost_hosts_member_is_built_on_the_spare_host_and_the_returned_one_removed_once_it_streams(
        world: World) -> None:
    world.lost["h2"] = (time.time() - 5, "libvirtd does not answer")
    assert world.repairer.repair(1, "restart").steps == (), "not lost before host_timeout_s"
    assert world.provisioner.built == []

    world.lost["h2"] = (time.time() - 31, "libvirtd does not answer")
    result = world.repairer.repair(1, "restart")
    assert world.provisioner.built == ["pgc-01-s3 on h4"]
    [step] = result.steps
    assert step.action == Action.REBUILD
    assert step.message == "built pgc-01-s3 on h4 in place of pgc-01-s1 (host h2 lost); Patroni cloned it"
    assert world.fleet.hosts["h4"].guest("pgc-01-s3").metadata.standby == 3
    assert world.repairer.repair(1, "restart").steps == (), "whole: nothing more is built"

    # h2 answers again; its guest did not survive the host's loss. It is not started again (a
    # returning former leader must not lead), and stays until its replacement streams.
    del world.lost["h2"]
    world.fleet.hosts["h2"].stop("pgc-01-s1")
    world.keys.streaming = {"pgc_01_s1", "pgc_01_s2"}  # its member key has not expired yet
    assert world.repairer.repair(1, "restart").steps == ()
    assert world.names()["pgc-01-s1"] == "h2" and world.fleet.hosts["h2"].guest("pgc-01-s1").state == "shut-off"
    assert world.removed == []

    world.keys.streaming = {"pgc_01_s2", "pgc_01_s3"}
    [step] = world.repairer.repair(1, "restart").steps
    assert (step.guest, step.action) == ("pgc-01-s1", Action.REMOVE)
    assert world.removed == ["pgc-01-s1 on h2"]
    assert world.names() == {"pgc-01": "h1", "pgc-01-s2": "h3", "pgc-01-s3": "h4"}


def test_a_running_member_that_was_replaced_is_removed_once_its_host_is_back(world: World) -> None:
    """A host cut off from the manager only (its guests ran on): once it answers, the member that
    was replaced goes, whatever Patroni made of it meanwhile."""
    world.lost["h3"] = (time.time() - 60, "libvirtd does not answer")
    world.repairer.repair(1, "restart")
    assert world.provisioner.built == ["pgc-01-s3 on h4"]
    del world.lost["h3"]
    world.keys.streaming = {"pgc_01_s1", "pgc_01_s2", "pgc_01_s3"}
    [step] = world.repairer.repair(1, "restart").steps
    assert (step.guest, step.action) == ("pgc-01-s2", Action.REMOVE)
    assert world.names() == {"pgc-01": "h1", "pgc-01-s1": "h2", "pgc-01-s3": "h4"}


def test_without_a_spare_host_the_shortfall_is_said_and_nothing_is_built(world: World) -> None:
    world.lost["h2"] = (time.time() - 60, "libvirtd does not answer")
    world.lost["h4"] = (time.time() - 60, "libvirtd does not answer")
    with pytest.raises(CapacityError, match=re.escape("pgc-01 is 1 member(s) short: no host answers and holds none "
                                                      "of its guests (h2, h4 not answering)")):
        world.repairer.repair(1, "restart")
    assert world.provisioner.built == [] and world.removed == []


def test_no_member_is_built_while_patroni_names_no_leader(world: World) -> None:
    world.keys.leader = None
    world.lost["h2"] = (time.time() - 60, "libvirtd does not answer")
    with pytest.raises(recovery.GuestNotReady, match="has no leader in etcd yet"):
        world.repairer.repair(1, "restart")
    assert world.provisioner.built == []
