"""Benchmarks: ``python -m bench [--size smoke|small|full] [--out bench/results] [--cases ...]``.

``make bench`` runs this module with ``$(BENCH_ARGS)``. Three parts, each written as JSON and a
PNG chart into ``--out``, plus ``summary.md`` rebuilt from every JSON found there (so parts run
separately still end up in one summary):

* ``control-plane`` (no guest boots; libvirt's test driver): reconcile 0 -> N pinned domains
  across 8 large test-driver hosts through the planner, ``DomainSpec`` and ``LibvirtHost``, in
  parallel the way ``Scaler`` does; ``GET /v1/instances`` latency at N through the real FastAPI
  app; the planner's time on a 512-CPU host; optionally the whole ``Scaler``/``Fleet`` path with
  only the guest-side waits stubbed.
* ``scale-out`` (boots guests): ``PUT /v1/scale`` until every new primary accepts writes with a
  streaming synchronous standby, split into control-plane time and guest boot.
* the experiment's cases ``carved``, ``single``, ``multi-process``, ``no-replica`` (boot guests):
  the insert-only pgbench load of ``../shared/seeds``, aggregate and per-instance TPS, latency
  percentiles from pgbench's per-transaction log, host and guest CPU user/system split, versions
  and a plain verdict.

Guest parts run in the local sandbox (state directory ``--state``, default
``/var/tmp/pgcarve-bench``), always stopped again in ``finally``, or on real hosts from
``--hosts-file`` (guests of a dedicated fleet name, removed at the end). See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libvirt
from pgcarve.config import FleetConfig, HostConfig, InstanceSize, Replication, load_fleet_config
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.scaler import Scaler
from pgcarve.errors import PgcarveError
from pgcarve.guest.seed import GuestSeed, write_seed_iso
from pgcarve.naming import instance_name
from pgcarve.planning.planner import PlannerConfig, capacity, plan_host
from pgcarve.planning.topology import HostTopology, parse_capabilities
from pgcarve.postgres.pgbench import CREATE_TABLE, INSERT_SCRIPT, PgbenchResult, pgbench_path, run_pgbench
from pgcarve.postgres.session import CLIENT_DATABASE
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import DomainSpec, InstanceMetadata, vcpu_pins_from_xml
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.storage import BaseImage
from psycopg import sql

REPO_DIR = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_DIR / "bench"
DEFAULT_OUT = BENCH_DIR / "results"
DEFAULT_STATE = Path("/var/tmp/pgcarve-bench")
TESTDRIVER_FILE = BENCH_DIR / "testdriver-host.xml"
CAPABILITIES_FILE = BENCH_DIR / "capabilities-2s32c2t.xml"
PLANNER_512_FILE = REPO_DIR / "tests" / "data" / "capabilities" / "eight-node-512t.xml"
BENCH_FLEET = "pgcbench"  # guests of the bench never share a name with an operator's fleet


def bench_fleet(kind: str) -> str:
    """A fleet name of its own for each group of bench guests, new on every run: "pgcb" + kind + 4 hex.

    Guest MACs derive from fleet and guest name, and libvirt keeps a DHCP lease per (MAC, client
    id); a guest re-created under the same name gets a new lease while the old one is still listed,
    and LibvirtHost.guest_address takes the first one, which can be the stale address. Fresh
    names give fresh MACs, so the bench never re-creates a name.
    """
    return f"pgcb{kind}{os.urandom(2).hex()}"
TOKEN = "pgcarve-bench-token-0123456789abcdef"  # noqa: S105  (in-process API of a throwaway state dir)
AUTH = {"Authorization": f"Bearer {TOKEN}"}

CONTROL_PLANE = "control-plane"
SCALE_OUT = "scale-out"
EXPERIMENT_CASES = ("carved", "single", "multi-process", "no-replica")
ALL_CASES = (CONTROL_PLANE, SCALE_OUT, *EXPERIMENT_CASES)

# Targets reported (not asserted) for the control plane.
TARGET_RECONCILE_S = 5.0
TARGET_GET_P99_MS = 20.0
TARGET_PLANNER_MS = 10.0
# Carved/single ratios inside this band are called "no clear difference".
NOISE_BAND = 0.05


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- sizes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """Every number a size fixes; command-line options override the experiment's ones."""

    name: str
    cp_instances: int
    cp_requests: int
    cp_scaler_path: bool
    scale_hosts: int  # sandbox hosts: h0 primary, the others standby hosts
    scale_standbys: int
    scale_steps: tuple[int, ...]  # instances added per step
    exp_hosts: int
    exp_standbys: int
    exp_instances: int  # N: carved instances, vCPUs of the single instance
    clients: int  # total pgbench clients per case (split over instances / tables)
    threads: int  # total pgbench threads per case
    seconds: int
    sampling_rate: float  # of pgbench's per-transaction log
    notes: tuple[str, ...] = ()


SIZES: dict[str, Size] = {
    "smoke": Size(
        name="smoke", cp_instances=64, cp_requests=200, cp_scaler_path=True,
        scale_hosts=1, scale_standbys=0, scale_steps=(1,),
        exp_hosts=2, exp_standbys=1, exp_instances=2, clients=4, threads=2, seconds=5, sampling_rate=1.0,
        notes=("proves the harness end to end: 5 s runs, one standby, +1 without standby",),
    ),
    "small": Size(
        name="small", cp_instances=256, cp_requests=500, cp_scaler_path=True,
        scale_hosts=2, scale_standbys=1, scale_steps=(1, 1),
        exp_hosts=2, exp_standbys=1, exp_instances=2, clients=8, threads=2, seconds=30, sampling_rate=1.0,
        notes=(
            "a sandbox host here is this 2-CPU machine, so it holds 2 one-vCPU slots: scale-out is +1 then "
            "+1 more (not +4) with one standby, and the experiment carves N=2 instead of 8",
            "all sandbox hosts share the same 2 physical CPUs, so primaries and standbys compete for them",
        ),
    ),
    "full": Size(
        name="full", cp_instances=256, cp_requests=500, cp_scaler_path=True,
        scale_hosts=3, scale_standbys=2, scale_steps=(1, 4),
        exp_hosts=3, exp_standbys=2, exp_instances=8, clients=64, threads=64, seconds=120, sampling_rate=0.02,
        notes=("the experiment's sizes: real hosts from --hosts-file, 8 guests, standbys on two other hosts, "
               "64 clients, 64 threads, 120 s",),
    ),
}


# -- small measurement helpers -------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (pct in 0..100); NaN-free: 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-pct * len(ordered) // 100))))
    return float(ordered[rank - 1])


def summarize_ms(values_ms: Sequence[float]) -> dict[str, float]:
    return {
        "count": float(len(values_ms)),
        "p50_ms": round(percentile(values_ms, 50), 3),
        "p90_ms": round(percentile(values_ms, 90), 3),
        "p99_ms": round(percentile(values_ms, 99), 3),
        "max_ms": round(max(values_ms), 3) if values_ms else 0.0,
        "mean_ms": round(statistics.fmean(values_ms), 3) if values_ms else 0.0,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")


def parse_proc_stat(text: str) -> dict[str, int]:
    """The aggregate ``cpu`` line of /proc/stat, in jiffies."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:]]
            return {name: values[i] if i < len(values) else 0 for i, name in enumerate(CPU_FIELDS)}
    raise PgcarveError("no aggregate cpu line in /proc/stat")


def cpu_split(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """User/system/idle/steal shares (0..1) between two /proc/stat samples.

    user includes nice (and the guest time the kernel also counts in user); system includes irq
    and softirq; idle includes iowait.
    """
    d = {k: after.get(k, 0) - before.get(k, 0) for k in CPU_FIELDS}
    user = d["user"] + d["nice"]
    system = d["system"] + d["irq"] + d["softirq"]
    idle = d["idle"] + d["iowait"]
    total = user + system + idle + d["steal"]
    if total <= 0:
        return {"user": 0.0, "system": 0.0, "idle": 0.0, "steal": 0.0, "guest": 0.0, "jiffies": 0.0}
    return {
        "user": round(user / total, 4),
        "system": round(system / total, 4),
        "idle": round(idle / total, 4),
        "steal": round(d["steal"] / total, 4),
        "guest": round((d["guest"] + d["guest_nice"]) / total, 4),
        "jiffies": float(total),
    }


def host_proc_stat() -> dict[str, int]:
    return parse_proc_stat(Path("/proc/stat").read_text())


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def run_meta(size: str) -> dict[str, Any]:
    return {
        "size": size,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "loadavg_at_start": loadavg()},
    }


# -- libvirt's test driver with a realistic topology ---------------------------------------------


def capabilities_xml(sockets: int = 2, cores: int = 32, threads: int = 2, memory_gib_per_node: int = 256) -> str:
    """Host capabilities of a NUMA host, one node per socket, numbered the way Linux does on x86
    (every core's first thread, then every second thread), as ``virsh capabilities`` prints it."""
    total_cores = sockets * cores
    root = ET.Element("capabilities")
    host = ET.SubElement(root, "host")
    cpu = ET.SubElement(host, "cpu")
    ET.SubElement(cpu, "arch").text = "x86_64"
    ET.SubElement(cpu, "topology", {"sockets": "1", "dies": "1", "cores": str(cores), "threads": str(threads)})
    cells = ET.SubElement(ET.SubElement(host, "topology"), "cells", {"num": str(sockets)})
    for node in range(sockets):
        cell = ET.SubElement(cells, "cell", {"id": str(node)})
        ET.SubElement(cell, "memory", {"unit": "KiB"}).text = str(memory_gib_per_node * 1024 * 1024)
        ET.SubElement(cell, "pages", {"unit": "KiB", "size": "4"}).text = str(memory_gib_per_node * 262144)
        ET.SubElement(cell, "pages", {"unit": "KiB", "size": "2048"}).text = "0"
        distances = ET.SubElement(cell, "distances")
        for other in range(sockets):
            ET.SubElement(distances, "sibling", {"id": str(other), "value": "10" if other == node else "21"})
        cpus = ET.SubElement(cell, "cpus", {"num": str(cores * threads)})
        for core in range(cores):
            first = node * cores + core
            siblings = [first + t * total_cores for t in range(threads)]
            for cpu_id in siblings:
                ET.SubElement(cpus, "cpu", {
                    "id": str(cpu_id), "socket_id": str(node), "die_id": "0", "core_id": str(core),
                    "siblings": ",".join(str(s) for s in siblings),
                })
    ET.indent(root)
    return ET.tostring(root, encoding="unicode") + "\n"


def testdriver_xml(sockets: int = 2, cores: int = 32, threads: int = 2, memory_gib_per_node: int = 256) -> str:
    """A libvirt test-driver node file: one large host with pgcarve's network and storage pool."""
    cpus = sockets * cores * threads
    return f"""<!-- libvirt test driver (test:///path/to/this.xml): one {sockets} socket x {cores} core x {threads}
     thread host with {sockets * memory_gib_per_node} GiB, pgcarve's network and storage pool.
     Every connection to a test:///FILE URI gets private state, so the control-plane benchmark
     opens it once per simulated host (8 hosts = 8 connections).
     libvirt's test driver reports <cells num='0'> for a node file (only test:///default has
     NUMA cells), so the planner reads capabilities-2s32c2t.xml beside this file instead. -->
<node>
  <cpu>
    <mhz>2500</mhz>
    <model>x86_64</model>
    <nodes>{sockets}</nodes>
    <sockets>1</sockets>
    <cores>{cores}</cores>
    <threads>{threads}</threads>
    <active>{cpus}</active>
  </cpu>
  <memory>{sockets * memory_gib_per_node * 1024 * 1024}</memory>
  <network>
    <name>pgcarve</name>
    <bridge name='pgcbr0'/>
    <forward mode='open'/>
    <ip address='10.77.0.1' netmask='255.255.255.0'>
      <dhcp>
        <range start='10.77.0.10' end='10.77.0.250'/>
      </dhcp>
    </ip>
  </network>
  <pool type='dir'>
    <name>pgcarve</name>
    <capacity unit='GiB'>8192</capacity>
    <allocation unit='GiB'>0</allocation>
    <available unit='GiB'>8192</available>
    <target>
      <path>/var/lib/libvirt/pgcarve</path>
    </target>
  </pool>
</node>
"""


def ensure_fixture(path: Path, text: str) -> Path:
    """The checked-in fixture if present, else a generated one in a temporary directory."""
    if path.exists():
        return path
    target = Path(tempfile.mkdtemp(prefix="pgcarve-bench-")) / path.name
    target.write_text(text)
    return target


class TestDriverHost(LibvirtHost):
    """A LibvirtHost on a test-driver node file; its topology comes from a capabilities file,
    uploads become empty volumes and overlays are 1 GiB (the test driver has no NUMA cells for
    node files, no virStorageVolUpload and 100 GiB pools). Everything else is the real LibvirtHost."""

    def __init__(self, name: str, uri: str, capabilities: str, pool: str = "pgcarve",
                 pool_path: str = "/var/lib/libvirt/pgcarve"):
        super().__init__(name, uri, pool, pool_path)
        self._capabilities = capabilities

    def topology(self) -> HostTopology:
        return parse_capabilities(self._capabilities)

    def create_overlay(self, name: str, base_volume: str, size_gib: int) -> None:
        # The test driver fixes every pool at 100 GiB: overlays are 1 GiB here so 62 fit a host.
        # The size is only a number in the volume XML; the call is the real one.
        super().create_overlay(name, base_volume, 1)

    def upload_file(self, name: str, source: Path) -> None:
        pool = self.storage.ensure_pool()
        with contextlib.suppress(libvirt.libvirtError):
            pool.storageVolLookupByName(name).delete(0)
        root = ET.Element("volume")
        ET.SubElement(root, "name").text = name
        ET.SubElement(root, "capacity", {"unit": "bytes"}).text = str(source.stat().st_size)
        ET.SubElement(ET.SubElement(root, "target"), "format", {"type": "raw"})
        pool.createXML(ET.tostring(root, encoding="unicode"), 0)


class TestDriverFleet(Fleet):
    """The real Fleet over TestDriverHosts. Only what needs a booted guest or an image is stubbed:
    the base image is an empty volume, and "PostgreSQL accepts SQL" is immediate."""

    BASE_VOLUME = "pgcarve-base-bench.qcow2"

    def __init__(self, config: FleetConfig, paths: Paths, capabilities: str):
        super().__init__(config, paths)
        self.hosts = {h.name: TestDriverHost(h.name, h.uri, capabilities, h.pool, h.pool_path)
                      for h in config.hosts}

    def image_on(self, host: str) -> BaseImage:
        with self._locks[host]:
            if host not in self._images:
                pool = self.hosts[host].storage.ensure_pool()
                if self.BASE_VOLUME not in pool.listVolumes():
                    pool.createXML(
                        f"<volume><name>{self.BASE_VOLUME}</name><capacity unit='GiB'>2</capacity>"
                        "<target><format type='qcow2'/></target></volume>", 0)
                self._images[host] = BaseImage(disk=self.BASE_VOLUME, kernel_path="/nonexistent/vmlinuz",
                                               initrd_path="/nonexistent/initrd.img")
            return self._images[host]

    def wait_sql(self, host: HostConfig, name: str, progress: Progress, standby: bool = False) -> Guest:
        return Guest(info=self.hosts[host.name].guest(name), address=None, endpoint=None)


def testdriver_config(hosts: int, uri: str, fleet: str = BENCH_FLEET) -> FleetConfig:
    return FleetConfig(
        fleet=fleet,
        domain_type="qemu",
        instance=InstanceSize(vcpus=1, memory_mib=4096, housekeeping_cpus=None, hugepages=False, disk_gib=8,
                              disk_reserve_mib=0),
        replication=Replication(standbys=0, sync_mode="FIRST", sync_count=1, synchronous_commit="remote_write"),
        hosts=[HostConfig(name=f"db{i + 1}", uri=uri, role="primary", pool="pgcarve",
                          pool_path="/var/lib/libvirt/pgcarve", network="pgcarve", reach="direct", netns=None)
               for i in range(hosts)],
    )


def _domain_spec(fleet: Fleet, host: HostConfig, index: int, image: BaseImage) -> DomainSpec:
    """The DomainSpec Fleet._create_guest builds for a primary."""
    name = instance_name(fleet.config.fleet, index)
    meta = InstanceMetadata(fleet=fleet.config.fleet, cluster=name, role="primary", index=index)
    domain_type = fleet.config.domain_type if fleet.config.domain_type != "auto" else "qemu"
    return fleet.domain_spec(host, name, meta, image, domain_type)


def reconcile_control_plane(fleet: Fleet, instances: int, parallel: int) -> dict[str, Any]:
    """Create instances 1..N: plan, overlay, DomainSpec, define + autostart + start (metadata in
    the XML), in a pool of `parallel` workers like Scaler.scale. Returns timings."""
    images = {h.name: fleet.image_on(h.name) for h in fleet.config.hosts}
    steps: dict[str, list[float]] = {"plan": [], "overlay": [], "spec": [], "define_start": []}
    lock = threading.Lock()

    def one(index: int) -> str:
        t0 = time.perf_counter()
        host, _standby_hosts = fleet.placement(index)
        t1 = time.perf_counter()
        lv = fleet.hosts[host.name]
        name = instance_name(fleet.config.fleet, index)
        lv.storage.create_overlay(f"{name}.qcow2", images[host.name].disk, fleet.config.instance.disk_gib)
        t2 = time.perf_counter()
        spec = _domain_spec(fleet, host, index, images[host.name])  # includes Fleet.slot (plan_host)
        t3 = time.perf_counter()
        lv.define_and_start(spec)
        t4 = time.perf_counter()
        with lock:
            steps["plan"].append(t1 - t0)
            steps["overlay"].append(t2 - t1)
            steps["spec"].append(t3 - t2)
            steps["define_start"].append(t4 - t3)
        return host.name

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, instances))) as pool:
        placed = list(pool.map(one, range(1, instances + 1)))
    wall = time.perf_counter() - start
    per_host: dict[str, int] = {}
    for name in placed:
        per_host[name] = per_host.get(name, 0) + 1
    return {
        "wall_s": round(wall, 4),
        "per_instance_ms": {k: summarize_ms([v * 1000 for v in vals]) for k, vals in steps.items()},
        "thread_time_s": {k: round(sum(vals), 4) for k, vals in steps.items()},
        "instances_per_host": per_host,
    }


def verify_pinning(fleet: Fleet, instances: int) -> dict[str, Any]:
    """Read every domain back (metadata and pinning from libvirt's XML) and check it."""
    observed = fleet.observe(with_endpoints=False)
    problems: list[str] = []
    used: dict[str, set[int]] = {}
    for inst in observed:
        if inst.primary is None:
            problems.append(f"{inst.name}: no primary")
            continue
        lv = fleet.hosts[inst.primary.info.host]
        pins, emulator = vcpu_pins_from_xml(lv.conn.lookupByName(inst.name).XMLDesc(0))
        _plan, slot = fleet.slot(inst.primary.info.host, inst.index)
        if pins != slot.host_cpus:
            problems.append(f"{inst.name}: pinned to {pins}, planned {slot.host_cpus}")
        host_used = used.setdefault(inst.primary.info.host, set())
        if host_used & set(pins):
            problems.append(f"{inst.name}: shares host CPUs {sorted(host_used & set(pins))}")
        if set(emulator) & set(pins):
            problems.append(f"{inst.name}: emulator threads on its own vCPUs")
        host_used.update(pins)
    if len(observed) != instances:
        problems.append(f"observed {len(observed)} instances, expected {instances}")
    return {"instances_observed": len(observed), "problems": problems[:20], "ok": not problems}


def time_observe(fleet: Fleet, repeat: int = 3) -> dict[str, float]:
    out: dict[str, float] = {}
    for with_endpoints in (False, True):
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fleet.observe(with_endpoints=with_endpoints)
            times.append((time.perf_counter() - t) * 1000)
        out["with_endpoints_ms" if with_endpoints else "metadata_only_ms"] = round(min(times), 2)
    return out


def measure_get(app: Any, path: str, requests: int, expect: int, transport: str) -> dict[str, Any]:
    """`requests` sequential GETs (after 20 warm-up ones) through TestClient or uvicorn on 127.0.0.1."""
    import httpx

    latencies: list[float] = []
    size = 0

    def loop(get: Callable[[str], Any]) -> None:
        nonlocal size
        first = get(path)
        if first.status_code != 200 or len(first.json()) != expect:
            raise PgcarveError(f"GET {path} returned {first.status_code} with {len(first.json())} items, "
                               f"expected 200 with {expect}")
        size = len(first.content)
        for _ in range(20):
            get(path)
        for _ in range(requests):
            t = time.perf_counter()
            resp = get(path)
            latencies.append((time.perf_counter() - t) * 1000)
            if resp.status_code != 200:
                raise PgcarveError(f"GET {path} returned {resp.status_code}")

    if transport == "testclient":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fastapi.testclient import TestClient

        with TestClient(app, base_url="http://127.0.0.1:8080") as client:  # a Host the API accepts
            loop(client.get)
    else:
        import uvicorn

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               access_log=False, lifespan="on"))
        thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not server.started:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise PgcarveError("uvicorn did not start in 20 s")
                time.sleep(0.05)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                loop(http.get)
        finally:
            server.should_exit = True
            thread.join(15)
    return {"transport": transport, "path": path, "response_bytes": size, **summarize_ms(latencies),
            "samples_ms": [round(x, 3) for x in latencies]}


def seed_iso_ms(fleet: Fleet, repeat: int = 5) -> float:
    """p50 time of one seed ISO build (genisoimage), as Fleet._create_guest does per guest."""
    seed = GuestSeed(name=instance_name(fleet.config.fleet, 1), role="primary", credentials=fleet.credentials,
                     allowed_cidrs=tuple(fleet.config.allowed_cidrs))
    times = []
    with tempfile.TemporaryDirectory(prefix="pgcarve-bench-seed-") as tmp:
        for k in range(repeat):
            t = time.perf_counter()
            write_seed_iso(seed, f"bench-{k}", Path(tmp) / f"seed-{k}.iso")
            times.append((time.perf_counter() - t) * 1000)
    return round(percentile(times, 50), 2)


def time_plan(topology: HostTopology, config: PlannerConfig, instances: int, repeat: int = 1) -> float:
    """The wall time in seconds of ``plan_host`` (best of ``repeat`` runs)."""
    best = float("inf")
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        plan_host(topology, config, instances)
        best = min(best, time.perf_counter() - start)
    return best


def planner_timing(repeat: int = 50) -> dict[str, Any]:
    """plan_host at full capacity on the 512-CPU, 8-node fixture (tests/data)."""
    if not PLANNER_512_FILE.exists():
        return {"skipped": f"{PLANNER_512_FILE} not found"}
    topo = parse_capabilities(PLANNER_512_FILE.read_text())
    out: dict[str, Any] = {"file": str(PLANNER_512_FILE.relative_to(REPO_DIR)), "host_cpus": topo.cpu_count,
                           "numa_nodes": len(topo.nodes)}
    for vcpus in (1, 8):
        cfg = PlannerConfig(vcpus_per_instance=vcpus, memory_mib_per_instance=4096)
        cap = capacity(topo, cfg)
        times = [time_plan(topo, cfg, cap) * 1000 for _ in range(repeat)]
        out[f"vcpus_{vcpus}"] = {"instances": cap, "best_ms": round(min(times), 3),
                                 "p50_ms": round(percentile(times, 50), 3), "max_ms": round(max(times), 3)}
    out["p50_ms"] = out["vcpus_1"]["p50_ms"]
    return out


def control_plane(out: Path | None, instances: int = 256, requests: int = 500, hosts: int = 8,
                  parallel: int = 8, scaler_path: bool = True, transports: Sequence[str] = ("testclient", "uvicorn"),
                  size: str = "custom", charts: bool = True) -> dict[str, Any]:
    """The control-plane benchmark on libvirt's test driver; writes control-plane.json/.png to `out`."""
    from pgcarve.control.service import ManagerService
    from pgcarve_api.main import create_app
    from pgcarve_api.settings import Settings

    doc: dict[str, Any] = {"part": CONTROL_PLANE, **run_meta(size)}
    td_file = ensure_fixture(TESTDRIVER_FILE, testdriver_xml())
    caps_file = ensure_fixture(CAPABILITIES_FILE, capabilities_xml())
    caps = caps_file.read_text()
    topo = parse_capabilities(caps)
    uri = f"test://{td_file.resolve()}"
    config = testdriver_config(hosts, uri)
    with tempfile.TemporaryDirectory(prefix="pgcarve-bench-cp-") as tmp:
        paths = Paths(Path(tmp))
        fleet = TestDriverFleet(config, paths, caps)
        service = ManagerService(config, paths, refresh_s=2.0, collect=False, supervise=False)
        service.fleet = fleet  # the service observes the test-driver connections the fleet created on
        service.scaler = Scaler(fleet)
        try:
            cap = fleet.capacity()
            doc["setup"] = {
                "libvirt_uri": f"test://{td_file.name if td_file.parent == BENCH_DIR else td_file}",
                "hosts": hosts,
                "host_topology": f"{topo.sockets} sockets x {topo.cores_per_socket} cores x "
                                 f"{topo.threads_per_core} threads = {topo.cpu_count} CPUs, {len(topo.nodes)} NUMA "
                                 f"nodes, {topo.memory_mib // 1024} GiB",
                "capabilities": caps_file.name,
                "instance": "1 vCPU (one whole core), 4096 MiB, no standbys",
                "fleet_capacity": cap,
                "parallel_workers": parallel,
                "libvirt": fleet.hosts[config.hosts[0].name].versions()["libvirt"],
            }
            if instances > cap:
                raise PgcarveError(f"{instances} instances do not fit the {hosts} test hosts (capacity {cap})")
            log(f"control plane: reconcile 0 -> {instances} on {hosts} test-driver hosts")
            doc["reconcile"] = reconcile_control_plane(fleet, instances, parallel)
            doc["reconcile"]["target_s"] = TARGET_RECONCILE_S
            doc["reconcile"]["meets_target"] = doc["reconcile"]["wall_s"] <= TARGET_RECONCILE_S
            doc["verify"] = verify_pinning(fleet, instances)
            doc["observe"] = time_observe(fleet)
            log(f"control plane: {requests} x GET /v1/instances at {instances} instances")
            service.start()
            app = create_app(Settings(state_dir=Path(tmp), token=TOKEN), service=service)
            # As served (the service refreshes its view every 2 s on a thread of this process), then
            # the same after gc.freeze(): a diagnostic for Python's full collections, which scan every
            # long-lived object (the app, pydantic models, the view) and stall requests behind them.
            gets = [{**measure_get(app, "/v1/instances", requests, instances, t), "variant": "as served"}
                    for t in transports]
            gc.collect()
            gc.freeze()
            try:
                gets.append({**measure_get(app, "/v1/instances", requests, instances, transports[-1]),
                             "variant": "gc.freeze() after start"})
            finally:
                gc.unfreeze()
            doc["get_instances"] = gets
            served = gets[len(transports) - 1]
            doc["get_instances_summary"] = {"p50_ms": served["p50_ms"], "p99_ms": served["p99_ms"],
                                            "transport": served["transport"], "variant": served["variant"],
                                            "p99_ms_gc_frozen": gets[-1]["p99_ms"],
                                            "target_p99_ms": TARGET_GET_P99_MS,
                                            "meets_target": served["p99_ms"] <= TARGET_GET_P99_MS}
            if scaler_path:
                log(f"control plane: Scaler.scale({instances} -> 0), then Scaler.scale(0 -> {instances}) "
                    "through Fleet.create_instance with the guest waits stubbed")
                scaler = Scaler(fleet)
                t = time.perf_counter()
                scaler.scale(0)
                down_s = time.perf_counter() - t
                t = time.perf_counter()
                scaler.scale(instances)
                up_s = time.perf_counter() - t
                doc["scaler_path"] = {
                    "scale_down_s": round(down_s, 3),
                    "scale_up_s": round(up_s, 3),
                    "seed_iso_build_ms_p50": seed_iso_ms(fleet),
                    "observe_at_n_ms": time_observe(fleet, repeat=1)["with_endpoints_ms"],
                    "scale_up_includes": "placement, plan, overlay, seed ISO (genisoimage) + empty seed volume, "
                                         "define + start, and Fleet.instance() = a full observe() per instance",
                    "stubbed": "image upload, seed upload (no virStorageVolUpload in the test driver), SQL wait",
                    "instances_after": len(fleet.observe(with_endpoints=False)),
                }
        finally:
            service.stop()
            fleet.close()
    doc["planner"] = planner_timing()
    doc["planner"]["target_ms"] = TARGET_PLANNER_MS
    doc["planner"]["meets_target"] = doc["planner"].get("p50_ms", 0) <= TARGET_PLANNER_MS
    doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["loadavg_at_end"] = loadavg()
    if out is not None:
        write_json(out / "control-plane.json", doc)
        if charts:
            save_chart(chart_control_plane, doc, out / "control-plane.png")
    return doc


# -- guests: sandbox or real hosts ---------------------------------------------------------------


def check_image(paths: Paths) -> None:
    if not (paths.image_dir / "inputs.sha256").exists():
        raise PgcarveError(f"no guest image in {paths.image_dir}: run `make image` or set PGCARVE_IMAGE_DIR")


@contextlib.contextmanager
def guest_hosts(paths: Paths, hosts: int, hosts_file: Path | None, record: dict[str, Any]) -> Iterator[FleetConfig]:
    """Real hosts from a hosts file, or a sandbox of `hosts` hosts that is always stopped again."""
    check_image(paths)
    if hosts_file is not None:
        config = load_fleet_config(hosts_file)
        record["hosts"] = {"kind": "hosts file", "file": str(hosts_file), "hosts": [h.name for h in config.hosts]}
        yield config
        return
    from pgcarve.sandbox.hosts import Sandbox

    sandbox = Sandbox(paths.sandbox_dir)
    if sandbox.is_up():
        raise PgcarveError(f"a sandbox is already up in {paths.sandbox_dir} (another bench running?); "
                           f"stop it with `PGCARVE_STATE_DIR={paths.state_dir} pgcarve sandbox down`")
    if sandbox.hosts() or sandbox.leftovers():
        sandbox.down()  # a crashed earlier bench run of this state directory left pieces
    record["hosts"] = {"kind": "sandbox", "state_dir": str(paths.state_dir), "hosts": hosts}
    try:
        log(f"sandbox: starting {hosts} host(s) in {paths.state_dir}")
        yield sandbox.up(hosts, progress=log)
    finally:
        log("sandbox: down")
        sandbox.down(progress=log)
        record["sandbox_leftovers"] = sandbox.leftovers()
        if record["sandbox_leftovers"]:
            log(f"sandbox left behind: {record['sandbox_leftovers']}")


def with_size(config: FleetConfig, vcpus: int | None = None, standbys: int | None = None,
              synchronous_commit: str | None = None, memory_mib: int | None = None,
              fleet: str | None = None) -> FleetConfig:
    instance = config.instance.model_copy(update={k: v for k, v in (("vcpus", vcpus), ("memory_mib", memory_mib))
                                                  if v is not None})
    repl_update: dict[str, Any] = {}
    if standbys is not None:
        repl_update["standbys"] = standbys
        if standbys:
            repl_update["sync_count"] = min(config.replication.sync_count, standbys)
    if synchronous_commit is not None:
        repl_update["synchronous_commit"] = synchronous_commit
    replication = config.replication.model_copy(update=repl_update)
    return FleetConfig.model_validate({**config.model_dump(mode="json"), "instance": instance.model_dump(),
                                       "replication": replication.model_dump(),
                                       "fleet": fleet or config.fleet})


def prepare_hosts(fleet: Fleet) -> dict[str, Any]:
    """Once per host, outside any timed section: upload the image, settle the domain type, and read
    the topology (a fresh libvirtd probes QEMU on its first getCapabilities, which takes seconds;
    a long-running one has that cached)."""
    t = time.perf_counter()
    types = {}
    for host in fleet.config.hosts:
        fleet.image_on(host.name)
        types[host.name] = fleet.domain_type(host.name)
        fleet.topology(host.name)
    return {"seconds": round(time.perf_counter() - t, 2), "domain_type": types, "capacity": fleet.capacity()}


def remove_all(fleet: Fleet) -> None:
    """Remove every guest of the bench fleet (no fencing: bench data is thrown away)."""
    for inst in fleet.observe(with_endpoints=False):
        with contextlib.suppress(PgcarveError):
            fleet.remove_instance(inst)


def progress_logger(prefix: str) -> Progress:
    last: dict[str, str] = {}
    lock = threading.Lock()

    def progress(name: str, step: str, _fraction: float) -> None:
        with lock:
            if last.get(name) != step:
                last[name] = step
                log(f"{prefix}{name}: {step}")

    return progress


# -- scale-out latency ---------------------------------------------------------------------------


@dataclass
class StepRecorder:
    """Timestamps of Fleet.create_instance's progress callbacks (monotonic, first of each step)."""

    events: list[tuple[float, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, step: str) -> None:
        with self.lock:
            self.events.append((time.monotonic(), name, step))

    def first(self, name: str, *prefixes: str) -> float | None:
        with self.lock:
            for t, n, step in self.events:
                if n == name and step.startswith(prefixes):
                    return t
        return None


class RecordingFleet(Fleet):
    """Fleet whose create_instance also records every progress step with its time."""

    def __init__(self, config: FleetConfig, paths: Paths, recorder: StepRecorder):
        super().__init__(config, paths)
        self.recorder = recorder

    def create_instance(self, index: int, progress: Progress = no_progress) -> Instance:
        def recording(name: str, step: str, fraction: float) -> None:
            self.recorder.record(name, step)
            progress(name, step, fraction)

        return super().create_instance(index, recording)


def write_probe(fleet: Fleet, guest: Guest, want_sync: bool) -> dict[str, Any]:
    """One committed insert on a new primary; with standbys, also its synchronous standby's state."""
    t = time.perf_counter()
    with fleet.connect(guest, database=CLIENT_DATABASE) as conn:
        conn.execute(CREATE_TABLE)
        conn.execute("insert into test(info) values ('scale-out probe')")
        rows = conn.execute("select application_name, state, sync_state from pg_stat_replication").fetchall()
    sync = [r for r in rows if r[1] == "streaming" and r[2] in ("sync", "quorum")]
    return {"commit_ms": round((time.perf_counter() - t) * 1000, 1),
            "streaming_sync_standbys": [str(r[0]) for r in sync],
            "ok": bool(sync) or not want_sync}


def scale_out(out: Path | None, paths: Paths, hosts: int, standbys: int, steps: Sequence[int],
              hosts_file: Path | None = None, size: str = "custom", notes: Sequence[str] = (),
              charts: bool = True) -> dict[str, Any]:
    """Time PUT /v1/scale -> every new primary accepts writes with a streaming sync standby."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    from pgcarve.control.service import ManagerService
    from pgcarve_api.main import create_app
    from pgcarve_api.settings import Settings

    doc: dict[str, Any] = {"part": SCALE_OUT, **run_meta(size), "notes": list(notes)}
    results: list[dict[str, Any]] = []
    doc["steps"] = results
    with guest_hosts(paths, hosts, hosts_file, doc) as base:
        config = with_size(base, standbys=standbys, fleet=bench_fleet("o"))
        (paths.state_dir / "operations.json").unlink(missing_ok=True)  # never resume an old bench's scale
        recorder = StepRecorder()
        service = ManagerService(config, paths, refresh_s=5.0, collect=False, supervise=False)
        fleet = RecordingFleet(config, paths, recorder)
        service.fleet = fleet
        service.scaler = Scaler(fleet)
        try:
            remove_all(fleet)
            doc["prepare"] = prepare_hosts(fleet)
            doc["setup"] = {"standbys": standbys, "instance": config.instance.model_dump(),
                            "synchronous_commit": config.replication.synchronous_commit,
                            "hosts": [f"{h.name} ({h.role})" for h in config.hosts]}
            service.start()
            app = create_app(Settings(state_dir=paths.state_dir, token=TOKEN), service=service)
            with TestClient(app, base_url="http://127.0.0.1:8080") as client:  # a Host the API accepts
                current = 0
                for add in steps:
                    target = current + add
                    log(f"scale-out: PUT /v1/scale {current} -> {target}")
                    recorder.events.clear()
                    t0 = time.monotonic()
                    resp = client.put("/v1/scale", json={"instances": target}, headers=AUTH)
                    put_ms = (time.monotonic() - t0) * 1000
                    if resp.status_code != 202:
                        raise PgcarveError(f"PUT /v1/scale {target}: {resp.status_code} {resp.text}")
                    op_id = resp.json()["operation"]
                    op = wait_operation(client, op_id, timeout_s=3600)
                    t_done = time.monotonic()
                    if op["status"] != "succeeded":
                        raise PgcarveError(f"scale to {target} failed: {op.get('error')}")
                    step: dict[str, Any] = {"from": current, "to": target, "added": add,
                                            "put_response_ms": round(put_ms, 1),
                                            "operation_s": round(t_done - t0, 2), "instances": []}
                    for index in range(current + 1, target + 1):
                        step["instances"].append(instance_breakdown(fleet, recorder, index, t0, standbys))
                    t_ready = [i["ready_s"] for i in step["instances"]]
                    step["all_ready_s"] = round(max(t_ready), 2)
                    step["control_plane_s"] = round(max(i["control_plane_s"] for i in step["instances"]), 2)
                    step["guest_boot_s"] = round(max(i["guest_boot_s"] for i in step["instances"]), 2)
                    step["all_writes_ok"] = all(i["write_probe"]["ok"] for i in step["instances"])
                    results.append(step)
                    log(f"scale-out: +{add} ready in {step['all_ready_s']} s (control plane "
                        f"{step['control_plane_s']} s, guest boot {step['guest_boot_s']} s)")
                    current = target
                log(f"scale-out: PUT /v1/scale {current} -> 0")
                t0 = time.monotonic()
                resp = client.put("/v1/scale", json={"instances": 0}, headers=AUTH)
                op = wait_operation(client, resp.json()["operation"], timeout_s=1800)
                doc["scale_in"] = {"from": current, "to": 0, "status": op["status"],
                                   "seconds": round(time.monotonic() - t0, 2)}
            doc["fleet_leftovers"] = fleet.leftovers()
        finally:
            service.stop()
            with contextlib.suppress(Exception):
                remove_all(fleet)
            fleet.close()
    doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["loadavg_at_end"] = loadavg()
    if out is not None:
        write_json(out / "scale-out.json", doc)
        if charts:
            save_chart(chart_scale_out, doc, out / "scale-out.png")
    return doc


def wait_operation(client: Any, op_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        op = client.get(f"/v1/operations/{op_id}").json()
        if op["status"] in ("succeeded", "failed"):
            return dict(op)
        time.sleep(0.25)
    raise PgcarveError(f"operation {op_id} did not finish in {timeout_s:.0f} s")


def instance_breakdown(fleet: Fleet, rec: StepRecorder, index: int, t0: float, standbys: int) -> dict[str, Any]:
    """Split one instance's creation into control-plane segments and guest-boot segments."""
    name = instance_name(fleet.config.fleet, index)

    def at(guest: str, *prefixes: str) -> float:
        t = rec.first(guest, *prefixes)
        if t is None:
            raise PgcarveError(f"no '{prefixes[0]}' step recorded for {guest}")
        return t - t0

    p_disk = at(name, "disk and seed")
    p_started = at(name, "booting", "waiting for PostgreSQL", "primary accepts SQL")
    p_sql = at(name, "primary accepts SQL")
    seg: dict[str, float] = {
        "queue_and_plan": p_disk,
        "primary_disk_seed_define_start": p_started - p_disk,
        "primary_boot_to_sql": p_sql - p_started,
    }
    ready = p_sql
    if standbys:
        snames = [f"{name}-s{s}" for s in range(1, standbys + 1)]
        s_started = max(at(s, "booting", "waiting for PostgreSQL", "standby replaying") for s in snames)
        ready = at(name, "ready")
        seg["standby_slots_disk_seed_define_start"] = s_started - p_sql
        seg["standby_boot_to_streaming"] = ready - s_started
    control = seg["queue_and_plan"] + seg["primary_disk_seed_define_start"] + seg.get(
        "standby_slots_disk_seed_define_start", 0.0)
    guest = fleet.instance(name).primary
    if guest is None:
        raise PgcarveError(f"{name} has no primary after the scale")
    probe = write_probe(fleet, guest, want_sync=bool(standbys))
    return {
        "instance": name,
        "segments_s": {k: round(v, 2) for k, v in seg.items()},
        "control_plane_s": round(control, 2),
        "guest_boot_s": round(ready - control, 2),
        "ready_s": round(ready, 2),
        "write_probe": probe,
    }


# -- the experiment ------------------------------------------------------------------------------

PROGRESS_RE = re.compile(r"^progress: ([0-9.]+) s, ([0-9.]+) tps, lat ([0-9.]+) ms", re.M)
REPORTED_SETTINGS = ("synchronous_commit", "synchronous_standby_names", "fsync", "full_page_writes",
                     "shared_buffers", "wal_buffers", "max_wal_size", "max_wal_senders", "max_connections",
                     "wal_level")


@dataclass(frozen=True)
class LoadTarget:
    guest: Guest
    label: str
    script: str
    clients: int
    jobs: int


def apply_settings(fleet: Fleet, guest: Guest, settings: dict[str, str]) -> dict[str, Any]:
    """ALTER SYSTEM + reload for settings that need no restart; report the rest as not applied."""
    applied, skipped = {}, {}
    with fleet.connect(guest) as conn:
        for name, value in settings.items():
            row = conn.execute("select context from pg_settings where name = %s", (name,)).fetchone()
            if row is None:
                skipped[name] = "unknown setting"
            elif row[0] in ("postmaster", "internal"):
                skipped[name] = f"needs a restart ({row[0]}); not applied"
            else:
                conn.execute(sql.SQL("alter system set {} = {}").format(sql.Identifier(name), sql.Literal(value)))
                applied[name] = value
        conn.execute("select pg_reload_conf()")
        time.sleep(0.3)
        rows = conn.execute("select name, setting, unit from pg_settings where name = any(%s)",
                            (list(REPORTED_SETTINGS) + list(settings),)).fetchall()
    effective = {str(r[0]): f"{r[1]}{'' if r[2] is None else ' x ' + str(r[2])}" for r in rows}
    return {"applied": applied, "not_applied": skipped, "effective": effective}


def guest_facts(fleet: Fleet, guest: Guest) -> dict[str, str]:
    facts: dict[str, str] = {}
    with fleet.connect(guest) as conn:
        row = conn.execute("select version()").fetchone()
        facts["postgresql"] = str(row[0]) if row else ""
        try:
            row = conn.execute("select pg_read_file('/proc/version', 0, 4096)").fetchone()
            facts["kernel"] = str(row[0]).strip() if row else ""
        except Exception as exc:
            facts["kernel"] = f"unavailable: {exc}"
    return facts


def guest_proc_stat(fleet: Fleet, guest: Guest) -> dict[str, int] | None:
    try:
        with fleet.connect(guest) as conn:
            row = conn.execute("select pg_read_file('/proc/stat', 0, 1048576)").fetchone()
        return parse_proc_stat(str(row[0])) if row else None
    except Exception:
        return None


def read_latencies(prefix: str) -> list[float]:
    """Per-transaction latencies (ms) from pgbench --log files PREFIX.PID[.N]."""
    values: list[float] = []
    for path in glob.glob(glob.escape(prefix) + ".*"):
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and parts[2].isdigit():
                    values.append(int(parts[2]) / 1000.0)
    return values


def run_load(fleet: Fleet, targets: Sequence[LoadTarget], seconds: int, sampling_rate: float,
             logdir: Path) -> dict[str, Any]:
    """pgbench on every target at once; host and guest CPU split over the run; latency logs."""
    guests = {t.guest.name: t.guest for t in targets}
    guest_before = {name: guest_proc_stat(fleet, g) for name, g in guests.items()}
    host_before = host_proc_stat()
    prefixes = {t.label: str(logdir / t.label) for t in targets}

    def one(target: LoadTarget) -> PgbenchResult:
        extra = ("-P", "1", "-l", f"--log-prefix={prefixes[target.label]}", f"--sampling-rate={sampling_rate}")
        return run_pgbench(target.guest.name, target.guest.endpoint, fleet.credentials.admin_password,
                           target.clients, target.jobs, seconds, script=target.script,
                           extra_args=extra)

    t = time.time()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        results = list(pool.map(one, targets))
    wall = time.time() - t
    host_after = host_proc_stat()
    guest_after = {name: guest_proc_stat(fleet, g) for name, g in guests.items()}
    per_target: list[dict[str, Any]] = []
    all_lat: list[float] = []
    for target, res in zip(targets, results, strict=True):
        lat = read_latencies(prefixes[target.label])
        all_lat.extend(lat)
        per_target.append({
            "label": target.label, "instance": target.guest.name, "clients": target.clients, "jobs": target.jobs,
            "tps": round(res.tps, 1), "transactions": res.transactions, "failed": res.failed,
            "latency_avg_ms": res.latency_avg_ms,
            "latency_p50_ms": round(percentile(lat, 50), 3), "latency_p99_ms": round(percentile(lat, 99), 3),
            "latency_samples": len(lat),
            "progress_tps": [float(m.group(2)) for m in PROGRESS_RE.finditer(res.output)],
        })
    guest_cpu = {}
    for name in guests:
        b, a = guest_before[name], guest_after[name]
        guest_cpu[name] = cpu_split(b, a) if b and a else None
    return {
        "aggregate_tps": round(sum(p["tps"] for p in per_target), 1),
        "latency_p50_ms": round(percentile(all_lat, 50), 3),
        "latency_p99_ms": round(percentile(all_lat, 99), 3),
        "latency_samples": len(all_lat),
        "wall_s": round(wall, 2),
        "host_cpu": cpu_split(host_before, host_after),
        "guest_cpu": guest_cpu,
        "per_instance": per_target,
    }


def _split(total: int, parts: int) -> int:
    return max(1, total // max(1, parts))


@dataclass(frozen=True)
class ExperimentParams:
    instances: int
    standbys: int
    clients: int
    threads: int
    seconds: int
    sampling_rate: float
    pg_settings: dict[str, str]
    memory_mib: int | None = None
    vcpus: int | None = None  # V, vCPUs per carved guest; None = 1 in the sandbox, the hosts file's on real hosts
    clients_per_target: bool = False  # False: `clients` split over the targets; True: each target gets them all

    def per_target(self, total: int, targets: int) -> int:
        return total if self.clients_per_target else _split(total, targets)


CASE_DOC = {
    "carved": "N instances (N guests of V vCPUs), one primary per guest, each with its synchronous standby(s) "
              "on other hosts; clients split evenly over the N primaries",
    "single": "one instance whose guest has N x V vCPUs, with its synchronous standby(s); all clients on it",
    "multi-process": "APPROXIMATION: N concurrent pgbench runs, each on its own table, against the single "
                     "instance's one primary (one postmaster, one WAL stream, one walsender) - not N PostgreSQL "
                     "clusters in one kernel as in the experiment; pgcarve cannot create extra clusters inside "
                     "a guest",
    "no-replica": "one instance with N x V vCPUs, replication.standbys 0 and synchronous_commit = local",
}


def run_case(case: str, fleet: Fleet, params: ExperimentParams, settings: dict[str, str],
             logdir: Path) -> dict[str, Any]:
    primaries = [inst.primary for inst in fleet.observe() if inst.primary and inst.primary.endpoint]
    if not primaries:
        raise PgcarveError(f"{case}: no reachable primary")
    n = params.instances

    def clients_jobs(targets: int) -> tuple[int, int]:
        clients = params.per_target(params.clients, targets)
        return clients, min(params.per_target(params.threads, targets), clients)

    if case == "multi-process":
        guest = primaries[0]
        with fleet.connect(guest, database=CLIENT_DATABASE) as conn:
            for k in range(1, n + 1):
                conn.execute(f"create table if not exists test{k}(id serial primary key, info text, "
                             "crt_time timestamp)")
        targets = [LoadTarget(guest, f"{case}-table{k}", f"insert into test{k}(info) values (null);\n",  # noqa: S608
                              *clients_jobs(n)) for k in range(1, n + 1)]
    elif case == "carved":
        targets = [LoadTarget(g, f"{case}-{g.name}", INSERT_SCRIPT, *clients_jobs(len(primaries)))
                   for g in primaries]
    else:
        targets = [LoadTarget(primaries[0], f"{case}-{primaries[0].name}", INSERT_SCRIPT, params.clients,
                              min(params.threads, params.clients))]
    conf = {g.name: apply_settings(fleet, g, settings) for g in primaries}
    log(f"{case}: pgbench on {len(targets)} target(s), {params.seconds} s")
    result = run_load(fleet, targets, params.seconds, params.sampling_rate, logdir)
    result.update({
        "case": case,
        "how": CASE_DOC[case],
        "approximation": case == "multi-process",
        "script": targets[0].script.strip() if case != "multi-process" else "insert into testK(info) values (null);",
        "postgresql_conf": conf,
        "guests": {g.name: {"host": g.info.host, "vcpus": len(g.info.vcpu_pins),
                            "host_cpus": list(g.host_cpus), "memory_mib": g.info.memory_mib} for g in primaries},
        "standbys": fleet.config.replication.standbys,
    })
    log(f"{case}: {result['aggregate_tps']} TPS, p50 {result['latency_p50_ms']} ms, p99 {result['latency_p99_ms']} ms")
    return result


@contextlib.contextmanager
def instances_up(config: FleetConfig, paths: Paths, count: int, record: dict[str, Any]) -> Iterator[Fleet]:
    fleet = Fleet(config, paths)
    try:
        remove_all(fleet)
        t = time.monotonic()
        Scaler(fleet).scale(count, progress_logger("  "))
        record["boot_s"] = round(time.monotonic() - t, 1)
        yield fleet
    finally:
        with contextlib.suppress(Exception):
            remove_all(fleet)
        fleet.close()


def verdict(results: dict[str, dict[str, Any]], domain_types: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    carved = results.get("carved", {}).get("aggregate_tps")
    for other in ("single", "no-replica", "multi-process"):
        base = results.get(other, {}).get("aggregate_tps")
        if carved and base:
            out[f"carved_over_{other.replace('-', '_')}"] = round(carved / base, 3)
    ratio = out.get("carved_over_single")
    if ratio is None:
        out["text"] = "no verdict: needs both the carved and the single case"
    elif ratio >= 1 + NOISE_BAND:
        out["text"] = (f"carving helped by {(ratio - 1) * 100:.0f}% on this host "
                       f"({carved:.0f} TPS carved vs {results['single']['aggregate_tps']:.0f} TPS single)")
    elif ratio <= 1 - NOISE_BAND:
        out["text"] = (f"carving did not help on this host: it cost {(1 - ratio) * 100:.0f}% "
                       f"({carved:.0f} TPS carved vs {results['single']['aggregate_tps']:.0f} TPS single)")
    else:
        out["text"] = (f"carving did not help on this host: no clear difference ({(ratio - 1) * 100:+.0f}%, within "
                       f"+-{NOISE_BAND * 100:.0f}%; {carved:.0f} vs {results['single']['aggregate_tps']:.0f} TPS)")
    if any(t != "kvm" for t in domain_types.values()):
        out["caveat"] = ("guests ran under QEMU TCG (software emulation, no usable KVM): the figures measure "
                         "the emulator, not the kernel locks carving is about; rerun on a KVM host")
    return out


def host_versions() -> dict[str, str]:
    versions = {"kernel": platform.release(), "proc_version": Path("/proc/version").read_text().strip()}
    with contextlib.suppress(Exception):
        versions["pgbench"] = subprocess.run([pgbench_path(), "--version"], capture_output=True, text=True,
                                             check=False).stdout.strip()
    for server in sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres")):
        with contextlib.suppress(Exception):
            versions["postgresql_server"] = subprocess.run([server, "--version"], capture_output=True, text=True,
                                                           check=False).stdout.strip()
    qemu = shutil.which("qemu-system-x86_64")
    if qemu:
        with contextlib.suppress(Exception):
            versions["qemu"] = subprocess.run([qemu, "--version"], capture_output=True, text=True,
                                              check=False).stdout.splitlines()[0]
    return versions


def carry_over(previous: Path, doc: dict[str, Any]) -> None:
    """Keep cases of an earlier run with the same size and parameters that this run did not repeat
    (e.g. `--cases no-replica` after a full run); each case keeps its own measured_at."""
    if not previous.exists():
        return
    with contextlib.suppress(ValueError, KeyError, TypeError):
        prev = json.loads(previous.read_text())
        if prev.get("size") != doc["size"] or prev.get("params") != doc["params"]:
            return
        for case, result in prev["cases"].items():
            if case not in doc["cases"] and "error" not in result:
                doc["cases"][case] = {**result, "carried_over_from": prev.get("started_at")}


def experiment(out: Path | None, paths: Paths, cases: Sequence[str], params: ExperimentParams, hosts: int,
               hosts_file: Path | None = None, size: str = "custom", notes: Sequence[str] = (),
               charts: bool = True) -> dict[str, Any]:
    """The experiment's cases on fresh guests; writes experiment.json/.png."""
    doc: dict[str, Any] = {"part": "experiment", **run_meta(size), "notes": list(notes),
                           "params": {"instances_N": params.instances, "standbys": params.standbys,
                                      "clients_total": params.clients, "threads_total": params.threads,
                                      "seconds": params.seconds, "sampling_rate": params.sampling_rate,
                                      "pg_settings": params.pg_settings,
                                      "clients": "per instance/table" if params.clients_per_target
                                      else "split over the instances/tables",
                                      "pgbench": "pgbench -M prepared -n -r -P 1 -l -f insert.sql -c C -j J -T S"},
                           "versions": {"host": host_versions()}}
    results: dict[str, dict[str, Any]] = {}
    doc["cases"] = results
    logdir = Path(tempfile.mkdtemp(prefix="pgcarve-bench-logs-"))
    try:
        with guest_hosts(paths, hosts, hosts_file, doc) as base:
            base = with_size(base, standbys=params.standbys, memory_mib=params.memory_mib)
            probe_fleet = Fleet(base, paths)
            try:
                doc["prepare"] = prepare_hosts(probe_fleet)
                doc["versions"]["libvirt"] = probe_fleet.hosts[base.hosts[0].name].versions()
            finally:
                probe_fleet.close()
            domain_types = doc["prepare"]["domain_type"]
            v = params.vcpus or (base.instance.vcpus if hosts_file is not None else 1)
            doc["params"]["vcpus_per_carved_instance_V"] = v
            doc["params"]["vcpus_single_instance"] = v * params.instances
            plan: list[tuple[FleetConfig, int, list[str]]] = []
            if "carved" in cases:
                plan.append((with_size(base, vcpus=v, fleet=bench_fleet("c")), params.instances, ["carved"]))
            together = [c for c in ("single", "multi-process") if c in cases]
            if together:
                plan.append((with_size(base, vcpus=v * params.instances, fleet=bench_fleet("s")), 1, together))
            if "no-replica" in cases:
                plan.append((with_size(base, vcpus=v * params.instances, standbys=0, synchronous_commit="local",
                                       fleet=bench_fleet("n")), 1,
                             ["no-replica"]))
            for config, count, group in plan:
                record: dict[str, Any] = {}
                log(f"{'/'.join(group)}: creating {count} instance(s) of {config.instance.vcpus} vCPU, "
                    f"{config.replication.standbys} standby(s)")
                try:
                    with instances_up(config, paths, count, record) as fleet:
                        first = next(i.primary for i in fleet.observe() if i.primary)
                        facts = guest_facts(fleet, first)
                        doc["versions"].setdefault("guest", facts)
                        for case in group:
                            settings = dict(params.pg_settings)
                            if case == "no-replica":
                                settings.setdefault("synchronous_commit", "local")
                            results[case] = run_case(case, fleet, params, settings, logdir)
                            results[case]["boot_s"] = record.get("boot_s")
                            results[case]["fleet"] = config.fleet
                            results[case]["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                except Exception as exc:  # one group failing still leaves the others' results
                    for case in group:
                        results[case] = {"case": case, "how": CASE_DOC[case], "error": str(exc)}
                    log(f"{'/'.join(group)} failed: {exc}")
            if out is not None:
                carry_over(out / "experiment.json", doc)
            doc["verdict"] = verdict(results, domain_types)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["loadavg_at_end"] = loadavg()
    if out is not None:
        write_json(out / "experiment.json", doc)
        if charts:
            save_chart(chart_experiment, doc, out / "experiment.png")
    return doc


# -- charts --------------------------------------------------------------------------------------


def save_chart(draw: Callable[[dict[str, Any], Path], None], doc: dict[str, Any], path: Path) -> None:
    """Draw a chart; without matplotlib (a dev dependency) say so and go on."""
    try:
        draw(doc, path)
    except ImportError as exc:
        log(f"no chart {path.name}: {exc} (pip install matplotlib)")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_control_plane(doc: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    rec = doc["reconcile"]
    n = doc["verify"]["instances_observed"]
    ax = axes[0]
    steps = list(rec["per_instance_ms"])
    p50 = [rec["per_instance_ms"][k]["p50_ms"] for k in steps]
    p99 = [rec["per_instance_ms"][k]["p99_ms"] for k in steps]
    rows = range(len(steps))
    ax.barh([y - 0.2 for y in rows], p50, 0.4, label="p50", color="#3b6ea8")
    ax.barh([y + 0.2 for y in rows], p99, 0.4, label="p99", color="#e6a23c")
    ax.set_yticks(list(rows), steps)
    ax.invert_yaxis()
    ax.set_xlabel("ms per instance")
    met = "meets" if rec["wall_s"] <= TARGET_RECONCILE_S else "misses"
    ax.set_title(f"reconcile 0 -> {n}: {rec['wall_s']:.2f} s wall\n({met} the {TARGET_RECONCILE_S:.0f} s target; "
                 f"{doc['setup']['hosts']} test-driver hosts)", fontsize=10)
    ax.legend()
    ax = axes[1]
    for g in doc["get_instances"]:
        samples = sorted(g["samples_ms"])
        ys = [(i + 1) / len(samples) for i in range(len(samples))]
        ax.plot(samples, ys, label=f"{g['transport']}, {g.get('variant', '?')}: p50 {g['p50_ms']:.1f} / "
                                   f"p99 {g['p99_ms']:.1f} ms")
    ax.axvline(TARGET_GET_P99_MS, color="#c0392b", linestyle="--", label=f"p99 target {TARGET_GET_P99_MS:.0f} ms")
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xticks([t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
                   if t <= max(max(g["samples_ms"]) for g in doc["get_instances"]) * 2])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("GET /v1/instances latency (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"GET /v1/instances at {n} instances")
    ax.legend(fontsize=8)
    ax = axes[2]
    pl = doc["planner"]
    if "vcpus_1" in pl:
        keys = [k for k in ("vcpus_1", "vcpus_8") if k in pl]
        ax.bar([f"{k.replace('_', ' ')}\n{pl[k]['instances']} inst." for k in keys], [pl[k]["p50_ms"] for k in keys],
               color="#3b6ea8")
        ax.axhline(TARGET_PLANNER_MS, color="#c0392b", linestyle="--", label=f"target {TARGET_PLANNER_MS:.0f} ms")
        ax.set_ylabel("ms (p50)")
        ax.set_title(f"plan_host on {pl['host_cpus']} CPUs / {pl['numa_nodes']} nodes")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def chart_scale_out(doc: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels, cp, boot = [], [], []
    for step in doc.get("steps", []):
        labels.append(f"+{step['added']} ({step['from']}->{step['to']})")
        cp.append(step["control_plane_s"])
        boot.append(step["all_ready_s"] - step["control_plane_s"])
    ax.bar(labels, cp, label="control plane (plan, disk, seed, define, start)", color="#3b6ea8")
    ax.bar(labels, boot, bottom=cp, label="guest boot to SQL / streaming standby", color="#e6a23c")
    for i, (c, b) in enumerate(zip(cp, boot, strict=True)):
        ax.text(i, c + b, f"{c + b:.1f} s (control plane {c:.1f} s)", ha="center", va="bottom")
    ax.set_ylabel("seconds from PUT /v1/scale")
    ax.set_title("scale-out: PUT /v1/scale until every new primary takes writes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def chart_experiment(doc: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    cases = [c for c in EXPERIMENT_CASES if c in doc["cases"] and "aggregate_tps" in doc["cases"][c]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for i, case in enumerate(cases):
        bottom = 0.0
        for p in doc["cases"][case]["per_instance"]:
            ax.bar(i, p["tps"], bottom=bottom, color="#3b6ea8" if case != "multi-process" else "#9bb7d4",
                   edgecolor="white")
            bottom += p["tps"]
        ax.text(i, bottom, f"{bottom:.0f}", ha="center", va="bottom")
    ax.set_xticks(range(len(cases)), [c + ("\n(approx.)" if c == "multi-process" else "") for c in cases])
    ax.set_ylabel("TPS (stacked per instance / table)")
    ax.set_title("aggregate insert TPS")
    ax = axes[1]
    width = 0.38
    ax.bar([i - width / 2 for i in range(len(cases))], [doc["cases"][c]["latency_p50_ms"] for c in cases], width,
           label="p50", color="#3b6ea8")
    ax.bar([i + width / 2 for i in range(len(cases))], [doc["cases"][c]["latency_p99_ms"] for c in cases], width,
           label="p99", color="#e6a23c")
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("ms per transaction")
    ax.set_title("latency (pgbench per-transaction log)")
    ax.legend()
    ax = axes[2]
    user = [doc["cases"][c]["host_cpu"]["user"] * 100 for c in cases]
    system = [doc["cases"][c]["host_cpu"]["system"] * 100 for c in cases]
    ax.bar(cases, user, label="user", color="#3b6ea8")
    ax.bar(cases, system, bottom=user, label="system", color="#c0392b")
    ax.set_ylim(0, 120)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("% of host CPU")
    ax.set_title("host CPU during the run")
    ax.legend(loc="upper right", ncol=2)
    verdict_text = doc.get("verdict", {}).get("text", "")
    fig.suptitle(verdict_text, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- summary -------------------------------------------------------------------------------------


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" (meets target)" if ok else " (**misses target**)")


def _hosts_text(doc: dict[str, Any]) -> str:
    hosts = doc.get("hosts") or {}
    if hosts.get("kind") == "sandbox":
        return f"{hosts.get('hosts')} sandbox host(s) on this machine (state {hosts.get('state_dir')})"
    if hosts:
        return f"hosts file {hosts.get('file')}: {', '.join(hosts.get('hosts', []))}"
    return "hosts: n/a"


def _setup_text(setup: dict[str, Any]) -> str:
    if not setup:
        return "setup: n/a"
    inst = setup.get("instance", {})
    return (f"{setup.get('standbys')} standby(s) per primary, instances of {inst.get('vcpus')} vCPU / "
            f"{inst.get('memory_mib')} MiB, synchronous_commit {setup.get('synchronous_commit')}, "
            f"hosts {', '.join(setup.get('hosts', []))}")


def summary_markdown(out: Path) -> str:
    lines = ["# pgcarve benchmark results", "",
             "Written by `python -m bench` (`make bench`); each section comes from the JSON file named in "
             "it. See `bench/README.md` for what each part measures and how to reproduce it.", ""]
    cp_path = out / "control-plane.json"
    if cp_path.exists():
        cp = json.loads(cp_path.read_text())
        rec, setup = cp["reconcile"], cp["setup"]
        n = cp["verify"]["instances_observed"]
        lines += [f"## Control plane (libvirt test driver) — `{cp_path.name}`", "",
                  f"Size `{cp['size']}`, {cp['started_at']}, machine: {cp['machine']['cpus']} CPUs, kernel "
                  f"{cp['machine']['kernel']}, load average at start {cp['machine']['loadavg_at_start']}.",
                  f"Hosts: {setup['hosts']} x ({setup['host_topology']}) on `{setup['libvirt_uri']}`; instance: "
                  f"{setup['instance']}; capacity {setup['fleet_capacity']}; libvirt {setup['libvirt']}.", "",
                  "| measure | result | target |", "|---|---|---|",
                  f"| reconcile 0 → {n} (plan + overlay + DomainSpec + define + start, {setup['parallel_workers']} "
                  f"workers) | {rec['wall_s']:.2f} s{_mark(rec['meets_target'])} | ≤ {TARGET_RECONCILE_S:.0f} s |"]
        for g in cp["get_instances"]:
            lines.append(f"| GET /v1/instances at {n}, {int(g['count'])} requests, {g['transport']}, "
                         f"{g.get('variant', '?')} | p50 "
                         f"{g['p50_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms{_mark(g['p99_ms'] <= TARGET_GET_P99_MS)} "
                         f"| p99 ≤ {TARGET_GET_P99_MS:.0f} ms |")
        pl = cp["planner"]
        if "vcpus_1" in pl:
            lines.append(f"| planner, {pl['host_cpus']} CPUs / {pl['numa_nodes']} nodes, {pl['vcpus_1']['instances']} "
                         f"instances | p50 {pl['vcpus_1']['p50_ms']:.2f} ms (best {pl['vcpus_1']['best_ms']:.2f})"
                         f"{_mark(pl['meets_target'])} | ≤ {TARGET_PLANNER_MS:.0f} ms |")
        lines += ["", f"Per-host placement: {rec['instances_per_host']} (primary hosts fill in order). "
                  "Read-back check: " + ("all pins as planned, no shared CPUs" if cp["verify"]["ok"]
                                         else str(cp["verify"]["problems"])) + ". "
                  f"A full `observe()` of the fleet: {cp['observe']['metadata_only_ms']:.0f} ms metadata only, "
                  f"{cp['observe']['with_endpoints_ms']:.0f} ms with addresses (the service's refresh).",
                  "",
                  "Per-instance step times (ms, p50 / p99): " + ", ".join(
                      f"{k} {v['p50_ms']:.2f} / {v['p99_ms']:.2f}" for k, v in rec["per_instance_ms"].items()) + "."]
        if "scaler_path" in cp:
            sp = cp["scaler_path"]
            lines += ["", f"Whole `Scaler`/`Fleet.create_instance` path, guest waits stubbed: scale 0 → {n} "
                      f"{sp['scale_up_s']:.1f} s, {n} → 0 {sp['scale_down_s']:.1f} s. Includes: "
                      f"{sp['scale_up_includes']}. Stubbed: {sp['stubbed']}. For scale: one seed ISO build "
                      f"takes {sp.get('seed_iso_build_ms_p50', '?')} ms and one observe() at {n} instances "
                      f"{sp.get('observe_at_n_ms', '?')} ms; create_instance does one of each per instance."]
        lines += ["", f"![control plane]({'control-plane.png'})", ""]
    so_path = out / "scale-out.json"
    if so_path.exists():
        so = json.loads(so_path.read_text())
        lines += [f"## Scale-out latency — `{so_path.name}`", "",
                  f"Size `{so['size']}`, {so['started_at']}, machine load average at start "
                  f"{so['machine']['loadavg_at_start']}; {_hosts_text(so)}; {_setup_text(so.get('setup', {}))}.",
                  f"One-time host preparation before the timed steps (image upload, domain type probe, "
                  f"topology): {so.get('prepare', {}).get('seconds', '?')} s; domain type "
                  f"{so.get('prepare', {}).get('domain_type')}.", ""]
        lines += [f"- {note}" for note in so.get("notes", [])]
        lines += ["", "| step | all new primaries writable (s) | control plane (s) | guest boot (s) | sync standby "
                  "on write |", "|---|---|---|---|---|"]
        sync_text = "yes" if so.get("setup", {}).get("standbys") else "n/a (no standbys)"
        for step in so.get("steps", []):
            lines.append(f"| +{step['added']} ({step['from']}→{step['to']}) | {step['all_ready_s']:.1f} | "
                         f"{step['control_plane_s']:.1f} | {step['guest_boot_s']:.1f} | "
                         f"{sync_text if step['all_writes_ok'] else 'NO'} |")
        for step in so.get("steps", []):
            for inst in step["instances"]:
                lines.append(f"\n`{inst['instance']}` (+{step['added']}): " + ", ".join(
                    f"{k} {v:.1f} s" for k, v in inst["segments_s"].items())
                    + f"; write probe {inst['write_probe']['commit_ms']} ms, sync standbys "
                    f"{inst['write_probe']['streaming_sync_standbys'] or 'none'}")
        if "scale_in" in so:
            lines.append(f"\nScale back to 0: {so['scale_in']['seconds']} s ({so['scale_in']['status']}).")
        lines += ["", f"Leftovers after `down()`: {so.get('sandbox_leftovers', 'n/a (real hosts)')}.", "",
                  "![scale-out](scale-out.png)", ""]
    ex_path = out / "experiment.json"
    if ex_path.exists():
        ex = json.loads(ex_path.read_text())
        p = ex["params"]
        lines += [f"## The experiment's cases — `{ex_path.name}`", "",
                  f"Size `{ex['size']}`, {ex['started_at']}, machine load average at start "
                  f"{ex['machine']['loadavg_at_start']}; {_hosts_text(ex)}. N = {p['instances_N']}, "
                  f"V = {p.get('vcpus_per_carved_instance_V', '?')} vCPU per carved guest (single guest: "
                  f"{p.get('vcpus_single_instance', '?')}), standbys {p['standbys']}, {p['clients_total']} clients / "
                  f"{p['threads_total']} threads ({p.get('clients', 'split over the instances/tables')}), "
                  f"{p['seconds']} s, script `{INSERT_SCRIPT.strip()}`, "
                  f"`{p['pgbench']}`.", ""]
        lines += [f"- {note}" for note in ex.get("notes", [])]
        lines += ["", "| case | aggregate TPS | per instance TPS | p50 ms | p99 ms | host CPU user/system | "
                  "guest CPU user/system | how |", "|---|---|---|---|---|---|---|---|"]
        for case in EXPERIMENT_CASES:
            r = ex["cases"].get(case)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {case} | failed: {r['error'][:120]} | | | | | | {r['how']} |")
                continue
            per = ", ".join(f"{q['tps']:.0f}" for q in r["per_instance"])
            cpu = r["host_cpu"]
            guests = [g for g in (r.get("guest_cpu") or {}).values() if g]
            guest_cpu = (f"{statistics.fmean(g['user'] for g in guests) * 100:.0f}% / "
                         f"{statistics.fmean(g['system'] for g in guests) * 100:.0f}%") if guests else "n/a"
            mark = (" (approx.)" if r.get("approximation") else "") + (
                f" (run of {r['carried_over_from']})" if r.get("carried_over_from") else "")
            lines.append(f"| {case}{mark} | {r['aggregate_tps']:.0f} | "
                         f"{per} | {r['latency_p50_ms']:.2f} | {r['latency_p99_ms']:.2f} | "
                         f"{cpu['user'] * 100:.0f}% / {cpu['system'] * 100:.0f}% | {guest_cpu} | {r['how']} |")
        v = ex.get("verdict", {})
        ratios = ", ".join(f"{k} = {val}" for k, val in v.items() if k.startswith("carved_over"))
        lines += ["", f"**Verdict: {v.get('text', 'n/a')}.**" + (f" Ratios: {ratios}." if ratios else "")]
        if v.get("caveat"):
            lines.append(f"\nCaveat: {v['caveat']}.")
        vers = ex.get("versions", {})
        host = vers.get("host", {})
        guest = vers.get("guest", {})
        lines += ["", "Versions: host kernel " + str(host.get("kernel")) + ", host " + str(host.get("pgbench")) +
                  (f", {host['qemu']}" if host.get("qemu") else "") + "; guest kernel `" +
                  str(guest.get("kernel", "n/a")) + "`, guest `" + str(guest.get("postgresql", "n/a")) + "`; "
                  f"domain type {ex.get('prepare', {}).get('domain_type')}.", "",
                  "![experiment](experiment.png)", ""]
    if len(lines) <= 4:
        lines.append("No results yet: run `make bench`.")
    return "\n".join(lines) + "\n"


def write_summary(out: Path) -> Path:
    path = out / "summary.md"
    path.write_text(summary_markdown(out))
    return path


# -- command line --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="smoke: minutes, proves the harness; small: this 2-CPU machine (default); "
                             "full: the experiment's sizes on real hosts (--hosts-file)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory (default bench/results)")
    parser.add_argument("--cases", nargs="+", choices=ALL_CASES, default=list(ALL_CASES), metavar="CASE",
                        help=f"any of {', '.join(ALL_CASES)} (default: all)")
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE,
                        help="state directory for the sandbox and secrets (default /var/tmp/pgcarve-bench)")
    parser.add_argument("--hosts-file", type=Path, default=None,
                        help="real hosts instead of the sandbox (needed for --size full)")
    g = parser.add_argument_group("control plane")
    g.add_argument("--cp-instances", type=int, help="instances to reconcile on the test driver")
    g.add_argument("--cp-requests", type=int, help="GET /v1/instances requests")
    g.add_argument("--no-scaler-path", action="store_true", help="skip the whole-Scaler path measurement")
    g = parser.add_argument_group("experiment")
    g.add_argument("--instances", type=int, help="N: carved instances and vCPUs of the single instance")
    g.add_argument("--standbys", type=int, help="standbys per primary")
    g.add_argument("--clients", type=int, help="total pgbench clients per case")
    g.add_argument("--threads", type=int, help="total pgbench threads per case")
    g.add_argument("--seconds", type=int, help="pgbench duration per case")
    g.add_argument("--sampling-rate", type=float, help="share of transactions written to pgbench's log")
    g.add_argument("--memory-mib", type=int, help="guest memory (default: the hosts file's / sandbox's)")
    g.add_argument("--vcpus", type=int, help="V: vCPUs per carved guest (the single guest gets N x V); default 1 "
                   "in the sandbox, instance.vcpus of the hosts file on real hosts")
    g.add_argument("--clients-per-instance", action="store_true",
                   help="every carved instance / multi-process table gets --clients (default: split them)")
    g.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                   help="postgresql.conf setting applied with ALTER SYSTEM before each case (repeatable; "
                        "settings that need a restart are reported, not applied)")
    g.add_argument("--force", action="store_true", help="run guest parts even when the load average is high")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    size = SIZES[args.size]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    hosts_file = args.hosts_file or (Path(os.environ["PGCARVE_HOSTS_FILE"]) if os.environ.get("PGCARVE_HOSTS_FILE")
                                     else None)
    settings: dict[str, str] = {}
    for item in args.pg_setting:
        name, sep, value = item.partition("=")
        if not sep or not re.match(r"^[a-z_][a-z0-9_.]*$", name):
            print(f"--pg-setting {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        settings[name] = value
    guest_cases = [c for c in args.cases if c != CONTROL_PLANE]
    if guest_cases and size.name == "full" and hosts_file is None:
        print("--size full runs the guest parts on real hosts: pass --hosts-file (see bench/README.md), "
              "or --cases control-plane", file=sys.stderr)
        return 2
    rc = 0
    if CONTROL_PLANE in args.cases:
        doc = control_plane(out, instances=args.cp_instances or size.cp_instances,
                            requests=args.cp_requests or size.cp_requests,
                            scaler_path=size.cp_scaler_path and not args.no_scaler_path, size=size.name)
        rec, get, pl = doc["reconcile"], doc["get_instances_summary"], doc["planner"]
        log(f"control plane: reconcile 0 -> {doc['verify']['instances_observed']} {rec['wall_s']:.2f} s, "
            f"GET p50 {get['p50_ms']:.1f} ms p99 {get['p99_ms']:.1f} ms, planner p50 {pl.get('p50_ms')} ms")
    load1 = loadavg()[0] if loadavg() else 0.0
    if guest_cases and size.name != "smoke" and hosts_file is None and load1 >= 2.5 and not args.force:
        log(f"load average {load1} >= 2.5: guest parts at size {size.name} would measure the other load too; "
            "skipped (use --size smoke, wait, or --force)")
        guest_cases, rc = [], 3
    if guest_cases:
        paths = Paths(args.state)
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        if SCALE_OUT in guest_cases:
            try:
                scale_out(out, paths, size.scale_hosts, args.standbys if args.standbys is not None
                          else size.scale_standbys, size.scale_steps, hosts_file, size.name, size.notes)
            except PgcarveError as exc:
                log(f"scale-out failed: {exc}")
                rc = 1
        exp_cases = [c for c in guest_cases if c in EXPERIMENT_CASES]
        if exp_cases:
            params = ExperimentParams(
                instances=args.instances or size.exp_instances,
                standbys=args.standbys if args.standbys is not None else size.exp_standbys,
                clients=args.clients or size.clients, threads=args.threads or size.threads,
                seconds=args.seconds or size.seconds,
                sampling_rate=args.sampling_rate or size.sampling_rate, pg_settings=settings,
                memory_mib=args.memory_mib, vcpus=args.vcpus, clients_per_target=args.clients_per_instance)
            try:
                doc = experiment(out, paths, exp_cases, params, size.exp_hosts, hosts_file, size.name, size.notes)
                log(f"verdict: {doc.get('verdict', {}).get('text')}")
                if any("error" in r for r in doc["cases"].values()):
                    rc = 1
            except PgcarveError as exc:
                log(f"experiment failed: {exc}")
                rc = 1
    summary = write_summary(out)
    log(f"wrote {summary}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
