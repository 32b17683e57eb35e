"""The benchmark harness: the control-plane part at a tiny size on libvirt's test driver (no guest
boots), and the pure helpers the guest parts rely on."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from pgcarve.planning.topology import parse_capabilities

from bench import harness_all as bench


def test_control_plane_smoke(tmp_path: Path) -> None:
    charts = importlib.util.find_spec("matplotlib") is not None
    doc = bench.control_plane(tmp_path, instances=16, requests=50, size="unit",
                              scaler_path=shutil.which("genisoimage") is not None, charts=charts)
    written = json.loads((tmp_path / "control-plane.json").read_text())
    assert written["part"] == "control-plane" and written["size"] == "unit"
    rec = written["reconcile"]
    assert rec["wall_s"] > 0 and set(rec["per_instance_ms"]) == {"plan", "overlay", "spec", "define_start"}
    assert sum(rec["instances_per_host"].values()) == 16
    assert written["verify"] == {"instances_observed": 16, "problems": [], "ok": True}
    gets = written["get_instances"]
    assert {g["transport"] for g in gets} == {"testclient", "uvicorn"} and len(gets) == 3
    for g in gets:
        assert g["count"] == 50 and 0 < g["p50_ms"] <= g["p99_ms"] <= g["max_ms"] and len(g["samples_ms"]) == 50
    summary = written["get_instances_summary"]
    assert {"p50_ms", "p99_ms", "target_p99_ms", "meets_target", "p99_ms_gc_frozen"} <= set(summary)
    planner = written["planner"]
    assert planner["host_cpus"] == 512 and planner["vcpus_1"]["instances"] > 0 and planner["p50_ms"] > 0
    assert {"target_s", "meets_target"} <= set(rec) and {"target_ms", "meets_target"} <= set(planner)
    if "scaler_path" in written:
        assert written["scaler_path"]["instances_after"] == 16
    assert doc["setup"]["fleet_capacity"] == 8 * 62
    if charts:
        assert (tmp_path / "control-plane.png").stat().st_size > 1000
    text = bench.summary_markdown(tmp_path)
    assert "reconcile 0 → 16" in text and "GET /v1/instances" in text


def test_fixtures_match_generators() -> None:
    assert bench.CAPABILITIES_FILE.read_text() == bench.capabilities_xml()
    assert bench.TESTDRIVER_FILE.read_text() == bench.testdriver_xml()
    topo = parse_capabilities(bench.capabilities_xml())
    assert (topo.cpu_count, topo.sockets, topo.cores_per_socket, topo.threads_per_core) == (128, 2, 32, 2)
    assert len(topo.nodes) == 2 and topo.memory_mib == 512 * 1024
    assert next(c for c in topo.cpus if c.id == 0).siblings == (0, 64)


def test_helpers() -> None:
    assert bench.percentile([], 99) == 0.0
    assert bench.percentile(list(range(1, 101)), 50) == 50
    assert bench.percentile(list(range(1, 101)), 99) == 99
    before = bench.parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    after = bench.parse_proc_stat("cpu  200 0 150 900 50 0 0 0 0 0\n")
    split = bench.cpu_split(before, after)
    assert split["user"] == split["system"] == split["idle"] and split["jiffies"] == 300


def test_verdict_words() -> None:
    kvm = {"h0": "kvm"}
    helped = bench.verdict({"carved": {"aggregate_tps": 190_000}, "single": {"aggregate_tps": 70_000}}, kvm)
    assert helped["text"].startswith("carving helped by 171%") and "caveat" not in helped
    flat = bench.verdict({"carved": {"aggregate_tps": 101}, "single": {"aggregate_tps": 100}}, kvm)
    assert flat["text"].startswith("carving did not help") and "no clear difference" in flat["text"]
    worse = bench.verdict({"carved": {"aggregate_tps": 50}, "single": {"aggregate_tps": 100},
                           "no-replica": {"aggregate_tps": 200}}, {"h0": "qemu"})
    assert "cost 50%" in worse["text"] and worse["carved_over_no_replica"] == 0.25 and "TCG" in worse["caveat"]
    assert "no verdict" in bench.verdict({}, kvm)["text"]
