"""A live pgcarve API for browser tests: the real app and ManagerService on libvirt's test driver.

No guest boots: two instances are defined as domains carrying pgcarve metadata on
test:///default (the driver's state lives in this process while a connection is open), and
throughput is fed straight into the service's RateTracker with growing counters, once a second.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import libvirt
import pytest
import uvicorn
from pgcarve.config import FleetConfig, Paths
from pgcarve.domain_xml import DomainSpec, InstanceMetadata, Nic, mac_for
from pgcarve.rates import Sample
from pgcarve.service import ManagerService
from pgcarve_api.main import create_app
from pgcarve_api.settings import Settings

TEST_URI = "test:///default"
TOKEN = "test-token"
INSTANCES = ("pgc-01", "pgc-02")
# Roughly what each instance does (TPS); QPS is a multiple of it. Enough for "K" headlines.
BASE_TPS = {"pgc-01": 9000.0, "pgc-02": 3500.0}
QUERIES_PER_XACT = {"pgc-01": 6.0, "pgc-02": 2.0}


@dataclass
class LiveApi:
    base_url: str
    token: str
    service: ManagerService
    instances: tuple[str, ...]
    capacity: int


def _define_instances(conn: libvirt.virConnect, service: ManagerService) -> list[str]:
    """Define and start one primary per instance, with pgcarve's metadata, pinned on NUMA node 0.

    Not where the planner would put instance 2 (node 1, CPUs 8-15): the test driver's
    capabilities list 16 CPUs but its node CPU map, and so vcpuPinInfo, only covers CPUs 0-7.
    """
    names = []
    vcpus = service.config.instance.vcpus
    plan, _slot = service.fleet.slot("h1", 1)
    for index, name in enumerate(INSTANCES, start=1):
        first = 1 + vcpus * (index - 1)
        spec = DomainSpec(
            name=name,
            domain_type="qemu",
            metadata=InstanceMetadata(fleet="pgc", cluster=name, role="primary", index=index),
            memory_mib=service.config.instance.memory_mib,
            vcpu_pins=tuple(range(first, first + vcpus)),
            emulator_cpus=tuple(c for c in plan.emulator_cpus if c < 8) or (0,),
            numa_node=0,
            kernel="/nonexistent/vmlinuz",
            initrd="/nonexistent/initrd.img",
            disks=(),
            nics=(Nic("default", mac_for("pgc", name)),),
        )
        dom = conn.defineXML(spec.to_xml())
        dom.create()
        names.append(name)
    return names


def _remove_instances(conn: libvirt.virConnect, names: list[str]) -> None:
    for name in names:
        try:
            dom = conn.lookupByName(name)
            if dom.isActive():
                dom.destroy()
            dom.undefine()
        except libvirt.libvirtError:
            pass


class Feeder:
    """Feeds the service's RateTracker like the collector would: samples, then record(), at 1 Hz."""

    def __init__(self, service: ManagerService, names: list[str]):
        self.tracker = service.tracker
        self.names = names
        self.xacts = dict.fromkeys(names, 1_000_000)
        self.calls = dict.fromkeys(names, 6_000_000)
        self.last = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tps-feeder", daemon=True)

    def feed_once(self) -> None:
        now = time.monotonic()
        dt = now - self.last
        self.last = now
        for i, name in enumerate(self.names):
            tps = BASE_TPS.get(name, 1000.0) * (1 + 0.2 * math.sin(now / 3 + 2 * i))
            qpx = QUERIES_PER_XACT.get(name, 4.0) * (1 + 0.3 * math.cos(now / 2 + i))
            self.xacts[name] += int(tps * dt)
            self.calls[name] += int(tps * dt * qpx)
            self.tracker.observe(Sample(instance=name, monotonic=now, wall=time.time(), xacts=self.xacts[name],
                                        calls=self.calls[name], replay_lag_bytes=None, epoch="browser-test"))
        self.tracker.record()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            self.feed_once()

    def start(self) -> None:
        self.feed_once()  # baselines (instances join with no rate yet)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture
def live_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    state_dir = tmp_path / "state"
    # No guest image on purpose: a scale-up is accepted, then fails fast with ImageMissing.
    monkeypatch.setenv("PGCARVE_IMAGE_DIR", str(tmp_path / "no-image"))
    monkeypatch.delenv("PGCARVE_HOSTS_FILE", raising=False)
    config = FleetConfig.model_validate({
        "hosts": [{"name": "h1", "uri": TEST_URI, "role": "primary"}],
        "instance": {"vcpus": 2, "memory_mib": 1024},
        "replication": {"standbys": 0},
    })
    # Keep one connection open for the whole test: test:///default's state is shared by every
    # connection of this process and is reset when the last one closes.
    conn = libvirt.open(TEST_URI)
    service = ManagerService(config, Paths(state_dir), collect=False, refresh_s=0.2, supervise=False)
    names: list[str] = []
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    feeder: Feeder | None = None
    try:
        names = _define_instances(conn, service)
        service.start()
        feeder = Feeder(service, names)
        feeder.start()

        app = create_app(Settings(state_dir=state_dir, token=TOKEN), service=service)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", timeout_graceful_shutdown=2))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the API server did not start within 10 s")
            time.sleep(0.05)
        yield LiveApi(base_url=f"http://127.0.0.1:{port}", token=TOKEN, service=service,
                      instances=tuple(names), capacity=service.fleet.capacity())
    finally:
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(10)
        if feeder is not None:
            feeder.close()
        service.wait_idle(10)
        service.stop()
        _remove_instances(conn, names)
        conn.close()
