"""A live pgcarve API on libvirt's test driver: the real app and ManagerService, served by uvicorn
on 127.0.0.1, for the browser and monitoring tests.

No guest boots: each instance is a running domain carrying pgcarve metadata on test:///default
(the driver's state lives in this process while a connection is open), and throughput is fed
straight into the service's RateTracker with growing counters, once a second. The service never
polls PostgreSQL (collect=False): the test driver hands out addresses of a real private range
(192.168.122.x), and nothing may connect there. Tests that need the collector's facts (commits
waiting, standbys, poll errors) install a FakeCollector (tests/support/fakes.py) instead.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libvirt
import uvicorn
from pgcarve.control.collector import Target
from pgcarve.control.rates import Sample
from pgcarve.control.service import ManagerService

from tests.support.api import app_for, service_on_test_driver
from tests.support.domains import TEST_URI, instance_names

TOKEN = "live-api-test-token-0123456789abcdef"
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
    conn: libvirt.virConnect = field(repr=False)
    feeder: Feeder = field(repr=False)

    def domain(self, name: str) -> libvirt.virDomain:
        return self.conn.lookupByName(name)


class Feeder:
    """Feeds the service like the collector would, once a second: each instance's counters to the
    RateTracker and to the collector's on_sample hooks (the /metrics exporter), then record()."""

    def __init__(self, service: ManagerService, names: Sequence[str], host: str = "h1",
                 tps: Callable[[str, int, float], float] | None = None):
        self.service = service
        self.tracker = service.tracker
        self.names = list(names)
        self.host = host
        self.xacts = dict.fromkeys(self.names, 1_000_000)
        self.calls = dict.fromkeys(self.names, 6_000_000)
        self.last = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tps-feeder", daemon=True)
        self.tps = tps or self.varying_tps

    @staticmethod
    def varying_tps(name: str, i: int, now: float) -> float:
        """Instance i's TPS at monotonic time `now`: its own level, +-20% over a few seconds."""
        return BASE_TPS.get(name, 500.0 + 40.0 * (i % 50)) * (1 + 0.2 * math.sin(now / 3 + 2 * i))

    def feed_once(self) -> None:
        now = time.monotonic()
        dt = now - self.last
        self.last = now
        hooks = list(getattr(self.service.collector, "on_sample", []))
        for i, name in enumerate(self.names):
            tps = self.tps(name, i, now)
            qpx = QUERIES_PER_XACT.get(name, 4.0) * (1 + 0.3 * math.cos(now / 2 + i))
            self.xacts[name] += int(tps * dt)
            self.calls[name] += int(tps * dt * qpx)
            sample = Sample(instance=name, monotonic=now, wall=time.time(), xacts=self.xacts[name],
                            calls=self.calls[name], replay_lag_bytes=None, epoch="live-api-test")
            self.tracker.observe(sample)
            for hook in hooks:
                hook(Target(instance=name, host=self.host, dsn=""), sample)
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


@contextlib.contextmanager
def serve_live_api(state_dir: Path, instances: int = 2, *, vcpus: int = 2, memory_mib: int = 1024,
                   prepare: Callable[[ManagerService], None] | None = None,
                   tps: Callable[[str, int, float], float] | None = None) -> Iterator[LiveApi]:
    """The app and a ManagerService on test:///default (tests/support/api.py) with instances
    pgc-01..pgc-<instances> running, served on a free loopback port. `prepare` runs before the app
    starts (e.g. to install fakes on the service); `tps` gives instance i's TPS at a moment
    (default: Feeder.varying_tps). The state directory has no guest image: a scale-up is accepted
    and then fails fast with ImageMissing.
    """
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    feeder: Feeder | None = None
    with service_on_test_driver(state_dir, instances, vcpus=vcpus, memory_mib=memory_mib) as service:
        conn = libvirt.open(TEST_URI)  # the tests' own handle on the domains (e.g. to stop one)
        try:
            if prepare is not None:
                prepare(service)
            app = app_for(service, token=TOKEN)
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
            # After the app started: its /metrics exporter has subscribed to the collector's samples.
            names = instance_names(instances)
            feeder = Feeder(service, names, tps=tps)
            feeder.start()
            yield LiveApi(base_url=f"http://127.0.0.1:{port}", token=TOKEN, service=service, instances=names,
                          capacity=service.fleet.placement.capacity(), conn=conn, feeder=feeder)
        finally:
            if server is not None:
                server.should_exit = True
            if thread is not None:
                thread.join(10)
            if feeder is not None:
                feeder.close()
            conn.close()
