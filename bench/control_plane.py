"""The control plane at scale, on libvirt's test driver (no guest boots).

Large simulated hosts (bench/simulated_hosts.py), as many as the instance count needs, behind
the real Fleet, Provisioner and Scaler, with tests/support/testdriver.py's stand-ins for what
the test driver cannot do and for PostgreSQL answering. Measures: reconcile 0 -> N pinned
domains in parallel, GET /v1/instances latency at N through the real app, the planner on a
512-CPU host, and optionally the whole Scaler path 0 -> N (target: TARGET_SCALE_UP_S). Writes
control-plane.json (and .png).
"""

from __future__ import annotations

import gc
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pgcarve.advice.measure import percentile
from pgcarve.config import HostConfig
from pgcarve.control.fleet import Fleet, Guest, Progress
from pgcarve.control.provisioning import Provisioner, Readiness
from pgcarve.control.retired import retired_instances
from pgcarve.control.retirement import purge
from pgcarve.control.roles_guard import configured_roles
from pgcarve.control.scaler import Scaler
from pgcarve.errors import PgcarveError
from pgcarve.guest.seed import write_seed_iso
from pgcarve.naming import disk_volume, instance_name
from pgcarve.planning.planner import PlannerConfig, capacity, plan_host
from pgcarve.planning.topology import HostTopology, parse_capabilities
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import DomainSpec, InstanceMetadata, vcpu_pins_from_xml
from pgcarve.virt.storage import BaseImage

from bench.charts import chart_control_plane, save_chart
from bench.harness import (
    BENCH_DIR,
    CONTROL_PLANE,
    REPO_DIR,
    TARGET_GET_P99_MS,
    TARGET_PLANNER_MS,
    TARGET_RECONCILE_S,
    TARGET_SCALE_UP_S,
    TOKEN,
    finish,
    free_port,
    log,
    run_meta,
    summarize_ms,
    write_json,
)
from bench.simulated_hosts import (
    CAPABILITIES_FILE,
    TESTDRIVER_FILE,
    capabilities_xml,
    ensure_fixture,
    hosts_for,
    testdriver_config,
    testdriver_xml,
)
from tests.support.testdriver import accepts_sql_at_once, stand_in_image, testdriver_fleet, testdriver_hosts

PLANNER_512_FILE = REPO_DIR / "tests" / "data" / "capabilities" / "eight-node-512t.xml"


def primary_spec(provisioner: Provisioner, host: HostConfig, index: int, image: BaseImage) -> DomainSpec:
    """The DomainSpec the provisioner builds for instance `index`'s primary (its slot from the plan)."""
    fleet = provisioner.fleet
    name = instance_name(fleet.config.fleet, index)
    meta = InstanceMetadata(fleet=fleet.config.fleet, cluster=name, role="primary", index=index,
                            roles=configured_roles(fleet.config))
    return provisioner.domain_spec(host, name, meta, image, fleet.domain_types.of(host.name))


def reconcile_control_plane(fleet: Fleet, instances: int, parallel: int) -> dict[str, Any]:
    """Create instances 1..N: placement, overlay, DomainSpec (with the plan), define + autostart +
    start (metadata in the XML), in a pool of `parallel` workers like Scaler.scale. Returns timings."""
    provisioner = Provisioner(fleet)
    images = {h.name: fleet.images.on(h.name) for h in fleet.config.hosts}
    steps: dict[str, list[float]] = {"plan": [], "overlay": [], "spec": [], "define_start": []}
    lock = threading.Lock()

    def one(index: int) -> str:
        t0 = time.perf_counter()
        host, _standby_hosts = fleet.placement.hosts_for(index)
        t1 = time.perf_counter()
        lv = fleet.hosts[host.name]
        disk = disk_volume(instance_name(fleet.config.fleet, index))
        lv.storage.create_overlay(disk, images[host.name].disk, fleet.config.instance.disk_gib)
        t2 = time.perf_counter()
        spec = primary_spec(provisioner, host, index, images[host.name])  # includes the plan (plan_host)
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
    """Read every domain back (metadata from libvirt, pinning from its XML) and check it."""
    observed = fleet.observe(with_endpoints=False)
    hosts = testdriver_hosts(fleet)
    placement = fleet.placement
    problems: list[str] = []
    used: dict[str, set[int]] = {}
    for inst in observed:
        if inst.primary is None:
            problems.append(f"{inst.name}: no primary")
            continue
        host = inst.primary.info.host
        pins, emulator = vcpu_pins_from_xml(hosts[host].domain_xml(inst.name))
        _plan, slot = placement.slot(host, inst.index)
        if pins != slot.host_cpus:
            problems.append(f"{inst.name}: pinned to {pins}, planned {slot.host_cpus}")
        host_used = used.setdefault(host, set())
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
    wall = 0.0

    def loop(get: Callable[[str], Any]) -> None:
        nonlocal size
        first = get(path)
        if first.status_code != 200 or len(first.json()) != expect:
            raise PgcarveError(f"GET {path} returned {first.status_code} with {len(first.json())} items, "
                               f"expected 200 with {expect}")
        size = len(first.content)
        for _ in range(20):
            get(path)
        nonlocal wall
        start = time.perf_counter()
        for _ in range(requests):
            t = time.perf_counter()
            resp = get(path)
            latencies.append((time.perf_counter() - t) * 1000)
            if resp.status_code != 200:
                raise PgcarveError(f"GET {path} returned {resp.status_code}")
        wall = time.perf_counter() - start

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
    return {"transport": transport, "path": path, "response_bytes": size, "wall_s": round(wall, 2),
            **summarize_ms(latencies),
            "samples_ms": [round(x, 3) for x in latencies]}


def seed_iso_ms(fleet: Fleet, repeat: int = 5) -> float:
    """p50 time of one seed ISO build (genisoimage), as Provisioner.create_guest does per guest."""
    seed = Provisioner(fleet).primary_seed(instance_name(fleet.config.fleet, 1), None)
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


MODELED_BOOT_S = 5.0  # a guest's boot to PostgreSQL on a KVM host, for the +1/+4 comparison


def boots_in(fleet: Fleet, seconds: float) -> Readiness:
    """The test driver's readiness (accepts_sql_at_once) after `seconds`, as if the guest booted."""
    at_once = accepts_sql_at_once(fleet)

    def ready(host: HostConfig, name: str, progress: Progress, standby: bool | None) -> Guest:
        time.sleep(seconds)
        return at_once(host, name, progress, standby)

    return ready


def measure_scaler_path(fleet: Fleet, instances: int) -> dict[str, Any]:
    """Scaler.scale(0), then Scaler.scale(N) through the real Provisioner.create_instance; only
    the wait for PostgreSQL is replaced (guests never boot on the test driver)."""
    log(f"control plane: Scaler.scale({instances} -> 0) (retires), purge, then Scaler.scale 0 -> 1 -> 5 (a modeled "
        f"{MODELED_BOOT_S:.0f} s boot) -> 6 -> 10 -> 0, purge, then 0 -> {instances} through "
        "Provisioner.create_instance with the guest waits stubbed")
    scaler = Scaler(fleet)
    scaler.provisioner = Provisioner(fleet, ready=accepts_sql_at_once(fleet))
    t = time.perf_counter()
    scaler.scale(0)
    down_s = time.perf_counter() - t
    # Scale-down retires (disks kept); purge them so that scale-up creates every instance anew.
    t = time.perf_counter()
    for retired in retired_instances(fleet):
        purge(fleet, retired.name)
    purge_s = time.perf_counter() - t
    # +1, then +4 at once: the Scaler builds up to max_parallel instances side by side, so +4
    # should cost little more than +1 (target: within 1.5x; each at most 1 s of control plane).
    # Real guests spend seconds booting, in parallel; here none boots, so each new guest's wait
    # for PostgreSQL stands in for a boot of MODELED_BOOT_S. Without that, +1 and +4 are tens of
    # milliseconds of Python under one lock (the GIL), and their ratio says nothing of parallelism.
    def plus_one_then_four(ready: Readiness, start: int) -> dict[str, float]:
        scaler.provisioner = Provisioner(fleet, ready=ready)
        took = {}
        for label, target in (("plus_one_s", start + 1), ("plus_four_s", start + 5)):
            t = time.perf_counter()
            scaler.scale(target)
            took[label] = time.perf_counter() - t
        return took

    modeled = plus_one_then_four(boots_in(fleet, MODELED_BOOT_S), 0)  # 0 -> 1 -> 5
    bare = plus_one_then_four(accepts_sql_at_once(fleet), 5)  # 5 -> 6 -> 10
    # Empty again (10 instances: cheap), so the whole scale-up is timed from an empty fleet.
    scaler.scale(0)
    for retired in retired_instances(fleet):
        purge(fleet, retired.name)
    t, cpu = time.perf_counter(), time.process_time()
    scaler.scale(instances)
    up_s, up_cpu_s = time.perf_counter() - t, time.process_time() - cpu

    plus_one_s, plus_four_s = modeled["plus_one_s"], modeled["plus_four_s"]
    control_one_s, control_four_s = plus_one_s - MODELED_BOOT_S, plus_four_s - MODELED_BOOT_S
    return {
        "scale_down_s": round(down_s, 3),
        "purge_retired_s": round(purge_s, 3),
        "modeled_boot_s": MODELED_BOOT_S,
        "plus_one_s": round(plus_one_s, 3),
        "plus_four_s": round(plus_four_s, 3),
        "plus_four_over_plus_one": round(plus_four_s / plus_one_s, 2),
        "control_plane_per_instance_s": round(max(control_one_s, control_four_s / 4), 3),
        "meets_plus_targets": control_one_s <= 1.0 and control_four_s <= 4.0 and plus_four_s <= 1.5 * plus_one_s,
        "bare_plus_one_s": round(bare["plus_one_s"], 3),
        "bare_plus_four_s": round(bare["plus_four_s"], 3),
        "scale_up_from": 0,
        "scale_up_s": round(up_s, 3),
        "scale_up_target_s": TARGET_SCALE_UP_S,
        "scale_up_meets_target": up_s <= TARGET_SCALE_UP_S,
        # This process's CPU over the same time (every thread; genisoimage's own is not in it): what
        # the control plane costs whatever else loads the machine.
        "scale_up_cpu_s": round(up_cpu_s, 3),
        "seed_iso_build_ms_p50": seed_iso_ms(fleet),
        "observe_at_n_ms": time_observe(fleet, repeat=1)["with_endpoints_ms"],
        "scale_up_includes": "one listing of every guest (capacity check and decision), then per instance: "
                             "placement, plan, overlay, seed ISO (genisoimage) + empty seed volume, define + start, "
                             "and a read of the instance's own guests",
        "stubbed": "image upload, seed upload (no virStorageVolUpload in the test driver), SQL wait",
        "instances_after": len(fleet.observe(with_endpoints=False)),
    }


def control_plane(out: Path | None, instances: int = 256, requests: int = 500, hosts: int | None = None,
                  parallel: int = 8, scaler_path: bool = True,
                  transports: Sequence[str] = ("testclient", "uvicorn"), size: str = "custom",
                  charts: bool = True) -> dict[str, Any]:
    """The control-plane benchmark on libvirt's test driver; writes control-plane.json/.png to `out`."""
    from pgcarve.control.service import ManagerService
    from pgcarve_api.main import create_app
    from pgcarve_api.settings import Settings

    doc: dict[str, Any] = {"part": CONTROL_PLANE, **run_meta(size)}
    td_file = ensure_fixture(TESTDRIVER_FILE, testdriver_xml())
    caps_file = ensure_fixture(CAPABILITIES_FILE, capabilities_xml())
    caps = caps_file.read_text()
    topo = parse_capabilities(caps)
    hosts = hosts or hosts_for(instances, topo)  # sized from the instance count: 1024 -> 17 hosts of 62
    config = testdriver_config(hosts, f"test://{td_file.resolve()}")
    with tempfile.TemporaryDirectory(prefix="pgcarve-bench-cp-") as tmp:
        paths = Paths(Path(tmp), image_dir=stand_in_image(Path(tmp) / "image"))
        fleet = testdriver_fleet(config, paths, caps)
        service = ManagerService(config, paths, refresh_s=2.0, collect=False, supervise=False)
        # The service observes the test-driver connections the fleet creates on (each connection
        # to a test:///FILE URI is a host of its own), so it works on that fleet.
        service.fleet = fleet
        service.scaler = Scaler(fleet)
        try:
            cap = fleet.placement.capacity()
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
                doc["scaler_path"] = measure_scaler_path(fleet, instances)
        finally:
            service.stop()
            fleet.close()
    doc["planner"] = planner_timing()
    doc["planner"]["target_ms"] = TARGET_PLANNER_MS
    doc["planner"]["meets_target"] = doc["planner"].get("p50_ms", 0) <= TARGET_PLANNER_MS
    finish(doc)
    if out is not None:
        write_json(out / "control-plane.json", doc)
        if charts:
            save_chart(chart_control_plane, doc, out / "control-plane.png")
    return doc
