"""The order in which Provisioner.create_instance builds an instance (control/provisioning.py):
standbys boot while their primary does, and none can stream or clone before the primary is
complete."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pgcarve.config import HostConfig
from pgcarve.control import provisioning
from pgcarve.control.fleet import Guest, Progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import InstanceMetadata, Role, mac_for
from pgcarve.virt.host import GuestInfo

from bench import simulated_hosts
from tests.support import testdriver as td


def _info(name: str, host: str, role: Role = "primary", standby: int = 0) -> GuestInfo:
    meta = InstanceMetadata(fleet="pgc", cluster="pgc-01", role=role, index=1, standby=standby)
    return GuestInfo(name=name, host=host, metadata=meta, state="running", vcpu_pins=((0,),), emulator_cpus=(),
                     memory_mib=1024, mac=None)


class Recorder(Provisioner):
    """The real orchestration; every step that would touch libvirt or a guest is written down."""

    def __init__(self, events: list[str], early_address: str = "10.77.0.5", answering_address: str = "10.77.0.5",
                 old_lease: str | None = None, reserved: str | None = None, standby_image: str = "base-1",
                 roles: str = "manager"):
        self.events = events
        self.roles_recorded: dict[str, str] = {}  # guest -> who decides roles, as its metadata says
        self.early_address, self.answering_address = early_address, answering_address

        def reserve(network: str, mac: str) -> str | None:
            self.events.append(f"reserve {mac}" if reserved else "no reservation")
            return reserved

        hosts = {name: SimpleNamespace(mark_complete=lambda n, h=name: self.events.append(f"complete {n}"),
                                       guest=lambda n, h=name: _info(n, h),
                                       guest_address=lambda n, network, mac: old_lease,
                                       reserve_address=reserve)
                 for name in ("h0", "h1", "h2")}
        images = {"h0": "base-1", "h1": standby_image, "h2": standby_image}
        fleet = SimpleNamespace(
            config=SimpleNamespace(fleet="pgc", replication=SimpleNamespace(roles=roles)), patroni=None,
            images=SimpleNamespace(on=lambda host: SimpleNamespace(disk=images[host])),
            placement=SimpleNamespace(hosts_for=lambda index: (
                HostConfig(name="h0", uri="test:///default"),
                [HostConfig(name="h1", uri="test:///default"), HostConfig(name="h2", uri="test:///default")])),
            hosts=hosts,
            locks=SimpleNamespace(exclusive=lambda index, why: contextlib.nullcontext()),
            connect=self._connect,
            instance_on=lambda index, built: SimpleNamespace(standbys=tuple(
                Guest(info=_info(name, host, "standby", n), address=None, endpoint=None)
                for n, (host, name) in enumerate(built[1:], start=1))),
        )
        super().__init__(fleet)  # type: ignore[arg-type]
        self.ready = self._ready

    @contextlib.contextmanager
    def _connect(self, guest: Guest, **_: Any) -> Iterator[Guest]:
        yield guest

    def primary_seed(self, name: str, record: Any) -> Any:
        return name

    def standby_seed(self, name: str, primary: Guest, rejoin: bool = False, from_image: bool = False) -> Any:
        return f"{name} {'streams' if from_image else 'clones'} from {primary.address}"

    def create_guest(self, host: HostConfig, name: str, meta: InstanceMetadata, seed: Any,
                     progress: Progress) -> None:
        self.events.append(f"start {name}" + (f" ({seed})" if meta.role == "standby" else ""))
        self.roles_recorded[name] = meta.roles

    def wait_address(self, host: HostConfig, name: str, progress: Progress) -> Guest:
        self.events.append(f"address {name}")
        return Guest(info=_info(name, host.name), address=self.early_address, endpoint=None)

    def _ready(self, host: HostConfig, name: str, progress: Progress, standby: bool | None) -> Guest:
        self.events.append(f"ready {name}")
        address = "10.77.1.9" if standby else self.answering_address
        return Guest(info=_info(name, host.name), address=address, endpoint=(address, 5432))

    def wait_streaming(self, primary: Guest, standbys: list[str], progress: Progress,
                       timeout_s: float = 300, renew_lease: bool = False) -> None:
        self.events.append("streaming")


@pytest.fixture(autouse=True)
def _no_guests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provisioning, "initial_record", lambda *args: None)
    monkeypatch.setattr(provisioning, "refresh_replication_access", lambda fleet, index: {})
    monkeypatch.setattr(provisioning, "failpoint", lambda name: None)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What happened, in order; replication slots made on the primary included."""
    happened: list[str] = []
    monkeypatch.setattr(provisioning.replication, "create_slot", lambda conn, slot: happened.append(f"slot {slot}"))
    return happened


def test_standbys_start_with_their_primary_at_its_reserved_address_and_stream_after_it_is_complete(
        events: list[str]) -> None:
    """The primary's address is reserved before it starts: its standbys start at once, from the
    image's data directory (same image on every host), and wait for nothing but the primary."""
    Recorder(events, reserved="10.77.0.5").create_instance(1)
    assert events[:4] == [f"reserve {mac_for('pgc', 'pgc-01')}", "start pgc-01",
                          "start pgc-01-s1 (pgc-01-s1 streams from 10.77.0.5)",
                          "start pgc-01-s2 (pgc-01-s2 streams from 10.77.0.5)"]
    assert events[4:6] == ["ready pgc-01", "complete pgc-01"]
    # Slots (what lets a standby stream) only once the primary has lost its "creating" mark.
    for n in (1, 2):
        assert events.index("complete pgc-01") < events.index(f"slot pgcarve_pgc_01_s{n}") \
            < events.index(f"ready pgc-01-s{n}")
    assert events[-3:] == ["streaming", "complete pgc-01-s1", "complete pgc-01-s2"]


@pytest.mark.parametrize("roles", ["manager", "patroni"])
def test_every_new_guest_records_who_decides_the_fleets_roles(events: list[str], roles: str) -> None:
    """Each guest's metadata says under which decider of roles it was made (control/roles_guard.py)."""
    recorder = Recorder(events, reserved="10.77.0.5", roles=roles)
    recorder.create_instance(1)
    assert recorder.roles_recorded == {"pgc-01": roles, "pgc-01-s1": roles, "pgc-01-s2": roles}


def test_a_standby_host_with_another_image_version_clones_instead(events: list[str]) -> None:
    Recorder(events, reserved="10.77.0.5", standby_image="base-2").create_instance(1)
    assert "start pgc-01-s1 (pgc-01-s1 clones from 10.77.0.5)" in events


def test_without_a_reservation_standbys_start_once_the_primary_has_an_address(events: list[str]) -> None:
    """A network that cannot hold a fixed address: the standbys wait for the primary's lease."""
    Recorder(events).create_instance(1)
    assert events[:5] == ["no reservation", "start pgc-01", "address pgc-01",
                          "start pgc-01-s1 (pgc-01-s1 streams from 10.77.0.5)",
                          "start pgc-01-s2 (pgc-01-s2 streams from 10.77.0.5)"]
    assert events[5:7] == ["ready pgc-01", "complete pgc-01"]
    # Slots (what lets a standby clone) only once the primary has lost its "creating" mark.
    for n in (1, 2):
        assert events.index("complete pgc-01") < events.index(f"slot pgcarve_pgc_01_s{n}") \
            < events.index(f"ready pgc-01-s{n}")
    assert events[-3:] == ["streaming", "complete pgc-01-s1", "complete pgc-01-s2"]


def test_a_standby_seeded_with_a_stale_address_is_built_again(monkeypatch: pytest.MonkeyPatch,
                                                              events: list[str]) -> None:
    """The primary showed an old lease of its MAC first: the standbys' seeds named it, so they
    are built again, the ordinary way, for the address the primary answers at."""
    rec = Recorder(events, reserved="10.77.0.4", answering_address="10.77.0.5")
    removed: list[str] = []
    monkeypatch.setattr(provisioning, "remove_guest", lambda fleet, info: removed.append(info.name))
    monkeypatch.setattr(rec.fleet.config, "host", lambda name: HostConfig(name=name, uri="test:///default"),
                        raising=False)  # the fake config has no such method
    rec.create_instance(1)
    assert sorted(removed) == ["pgc-01-s1", "pgc-01-s2"]
    rebuilt = [e for e in events if e.startswith("start pgc-01-s")][2:]
    assert sorted(rebuilt) == ["start pgc-01-s1 (pgc-01-s1 streams from 10.77.0.5)",
                               "start pgc-01-s2 (pgc-01-s2 streams from 10.77.0.5)"]


def test_a_name_with_an_old_lease_builds_its_standbys_once_the_primary_answers(events: list[str]) -> None:
    """pgc-01 existed before and its old DHCP lease is still listed: the address seen first may
    not be the new guest's, so the standbys are made the ordinary way, after the primary answers."""
    Recorder(events, old_lease="10.77.0.4").create_instance(1)
    assert "address pgc-01" not in events
    assert events[:4] == ["no reservation", "start pgc-01", "ready pgc-01", "complete pgc-01"]
    for n in (1, 2):
        assert events.index(f"slot pgcarve_pgc_01_s{n}") < events.index(
            f"start pgc-01-s{n} (pgc-01-s{n} streams from 10.77.0.5)") < events.index(f"ready pgc-01-s{n}")


def test_every_guest_of_a_multi_cluster_instance_is_told_how_many_clusters(tmp_path: Path) -> None:
    """instance.clusters reaches the standbys' seeds too: each clones every cluster of its
    primary (the image's pgcarve-clusters does nothing for a seed without it)."""
    hosts = simulated_hosts
    td_file = hosts.ensure_fixture(hosts.TESTDRIVER_FILE, hosts.testdriver_xml())
    caps = hosts.ensure_fixture(hosts.CAPABILITIES_FILE, hosts.capabilities_xml()).read_text()
    config = hosts.testdriver_config(1, f"test://{td_file.resolve()}")
    config = config.model_copy(update={"instance": config.instance.model_copy(update={"clusters": 3})})
    fleet = td.testdriver_fleet(config, Paths(tmp_path / "state", image_dir=td.stand_in_image(tmp_path / "image")),
                                caps)
    try:
        provisioner = Provisioner(fleet)
        primary = provisioner.primary_seed("pgc-01", None)
        addressed = Guest(info=_info("pgc-01", "db1"), address="10.77.0.5", endpoint=None)
        standby = provisioner.standby_seed("pgc-01-s1", addressed)
        assert primary.instance_json()["clusters"] == 3
        assert standby.instance_json()["clusters"] == 3
    finally:
        fleet.close()


def test_a_primary_too_busy_to_answer_is_asked_again_for_its_standbys_slots(
        monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Under emulation a primary beside booting guests and clones can miss a connection
    timeout: the slot is asked for again rather than the whole new instance failing."""
    import psycopg
    from pgcarve.errors import GuestNotReady

    monkeypatch.setattr(provisioning.time, "sleep", lambda s: None)
    rec = Recorder(events)
    busy = {"left": 2}
    real_connect = rec._connect

    @contextlib.contextmanager
    def sometimes_late(guest: Guest, **kwargs: Any) -> Iterator[Guest]:
        if busy["left"] > 0:
            busy["left"] -= 1
            raise psycopg.OperationalError("connection timeout expired")
        with real_connect(guest, **kwargs) as conn:
            yield conn

    monkeypatch.setattr(rec.fleet, "connect", sometimes_late)
    rec.create_instance(1)
    assert busy["left"] == 0
    assert {"slot pgcarve_pgc_01_s1", "slot pgcarve_pgc_01_s2"} <= set(events)
    # A primary that never answers: the error says who, what for and how long.
    busy["left"] = 10**6
    primary = Guest(info=_info("pgc-01", "h0"), address="10.77.0.5", endpoint=None)
    with pytest.raises(GuestNotReady, match=r"pgc-01 did not answer for 0 s to make the replication slot of "
                                            r"pgc-01-s1 \(last: connection timeout expired\)"):
        rec.make_slot(primary, "pgc-01-s1", timeout_s=0)
