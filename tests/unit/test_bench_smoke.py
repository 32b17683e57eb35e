"""The benchmark harness: the control-plane part at a tiny size on libvirt's test driver (no guest
boots), and the pure helpers the guest parts rely on.

Every check runs: genisoimage (the whole Scaler path builds real seed ISOs) is a Debian package
and matplotlib (the chart) a dev dependency, and `make test` installs both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
from pgcarve.advice import load, measure
from pgcarve.control.fleet import Fleet
from pgcarve.control.waits import WaitBreakdown
from pgcarve.errors import ConfigError
from pgcarve.planning.topology import parse_capabilities
from pgcarve.postgres.statistics import WAIT_CATEGORIES
from pgcarve.settings import Paths

from bench import control_plane, experiment, simulated_hosts, summary
from tests.support.testdriver import OVERLAY_GIB, TestDriverHost

REPO = Path(__file__).resolve().parents[2]


def test_control_plane_smoke(tmp_path: Path) -> None:
    assert shutil.which("genisoimage"), "genisoimage is missing: `make apt` installs it"
    doc = control_plane.control_plane(tmp_path, instances=16, requests=50, size="unit", scaler_path=True,
                                      charts=True)
    written = json.loads((tmp_path / "control-plane.json").read_text())
    assert written == json.loads(json.dumps(doc)), "the JSON written is the document returned"
    assert written["part"] == "control-plane" and written["size"] == "unit"
    rec = written["reconcile"]
    assert rec["wall_s"] > 0 and set(rec["per_instance_ms"]) == {"plan", "overlay", "spec", "define_start"}
    assert sum(rec["instances_per_host"].values()) == 16
    assert rec["instances_per_host"] == {"db1": 16}, "primary hosts fill in order"
    assert written["verify"] == {"instances_observed": 16, "problems": [], "ok": True}
    gets = written["get_instances"]
    assert {g["transport"] for g in gets} == {"testclient", "uvicorn"} and len(gets) == 3
    for g in gets:
        assert g["count"] == 50 and 0 < g["p50_ms"] <= g["p99_ms"] <= g["max_ms"] and len(g["samples_ms"]) == 50
    get_summary = written["get_instances_summary"]
    assert {"p50_ms", "p99_ms", "target_p99_ms", "meets_target", "p99_ms_gc_frozen"} <= set(get_summary)
    planner = written["planner"]
    assert planner["host_cpus"] == 512 and planner["vcpus_1"]["instances"] > 0 and planner["p50_ms"] > 0
    assert {"target_s", "meets_target"} <= set(rec) and {"target_ms", "meets_target"} <= set(planner)
    scaler = written["scaler_path"]
    assert scaler["instances_after"] == 16 and scaler["scale_up_s"] > 0 and scaler["seed_iso_build_ms_p50"] > 0
    assert 0 < scaler["plus_one_s"] and 0 < scaler["plus_four_s"] and isinstance(scaler["meets_plus_targets"], bool)
    assert doc["setup"]["hosts"] == 1 and doc["setup"]["fleet_capacity"] == 62, "hosts sized from the count"
    assert scaler["scale_up_from"] == 0 and isinstance(scaler["scale_up_meets_target"], bool)
    assert (tmp_path / "control-plane.png").stat().st_size > 1000
    text = summary.summary_markdown(tmp_path)
    assert "reconcile 0 → 16" in text and "GET /v1/instances" in text and "Whole `Scaler`" in text
    assert "| whole Scaler path 0 → 16 on 1 hosts" in text
    assert OVERLAY_GIB * 62 <= 100, "a test-driver pool (100 GiB) holds a host's 62 overlays"


def test_command_line_writes_into_out(tmp_path: Path) -> None:
    """`python -m bench --cases control-plane` writes its JSON, chart and summary into --out only."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "smoke", "--cases", "control-plane", "--cp-instances", "4",
         "--cp-requests", "5", "--no-scaler-path", "--out", str(out), "--state", str(tmp_path / "state")],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["control-plane.json", "control-plane.png", "summary.md"]
    doc = json.loads((out / "control-plane.json").read_text())
    assert doc["size"] == "smoke" and doc["verify"]["ok"] and "scaler_path" not in doc
    assert not (tmp_path / "state").exists(), "the control plane needs no state directory"


def test_stand_in_hosts_must_be_the_configured_ones(tmp_path: Path) -> None:
    """Fleet(hosts=...) takes exactly the hosts of its config: a stand-in cannot drop or add one."""
    config = simulated_hosts.testdriver_config(2, "test:///default")
    hosts = {h.name: TestDriverHost(h.name, h.uri, simulated_hosts.capabilities_xml()) for h in config.hosts}
    assert set(Fleet(config, Paths(tmp_path), hosts=hosts).hosts) == {"db1", "db2"}
    with pytest.raises(ConfigError, match="not the configured hosts"):
        Fleet(config, Paths(tmp_path), hosts={"db1": hosts["db1"]})


def test_fixtures_match_generators() -> None:
    assert simulated_hosts.CAPABILITIES_FILE.read_text() == simulated_hosts.capabilities_xml()
    assert simulated_hosts.TESTDRIVER_FILE.read_text() == simulated_hosts.testdriver_xml()
    topo = parse_capabilities(simulated_hosts.capabilities_xml())
    assert (topo.cpu_count, topo.sockets, topo.cores_per_socket, topo.threads_per_core) == (128, 2, 32, 2)
    assert len(topo.nodes) == 2 and topo.memory_mib == 512 * 1024
    assert next(c for c in topo.cpus if c.id == 0).siblings == (0, 64)


def test_helpers() -> None:
    assert measure.percentile([], 99) == 0.0
    assert measure.percentile(list(range(1, 101)), 50) == 50
    assert measure.percentile(list(range(1, 101)), 99) == 99
    before = measure.parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    after = measure.parse_proc_stat("cpu  200 0 150 900 50 0 0 0 0 0\n")
    split = measure.cpu_split(before, after)
    assert split["user"] == split["system"] == split["idle"] and split["jiffies"] == 300


def _case(*tps: float) -> dict[str, object]:
    return experiment.summarize_runs([{"aggregate_tps": t, "round": k} for k, t in enumerate(tps, start=1)])


def test_runs_summarized_by_their_median_and_spread() -> None:
    case = experiment.summarize_runs([{"aggregate_tps": 90.0, "p": "a"}, {"error": "boot failed"},
                                      {"aggregate_tps": 110.0, "p": "b"}, {"aggregate_tps": 101.0, "p": "c"}])
    assert case["aggregate_tps"] == 101.0 and case["p"] == "c", "the run nearest the median stands for the case"
    assert case["runs_tps"] == [90.0, 110.0, 101.0] and (case["tps_min"], case["tps_max"]) == (90.0, 110.0)
    assert case["spread"] == 0.198 and case["repeats"] == 3 and case["failed_runs"] == ["boot failed"]


def test_the_bench_verdict_is_the_advisors_with_the_other_cases_ratios() -> None:
    """The words themselves are pgcarve.advice.verdict's (tests/unit/test_advice_verdict.py)."""
    kvm = {"h0": "kvm"}
    helped = experiment.verdict({"carved": _case(185_000, 190_000, 195_000), "single": _case(68_000, 70_000, 72_000)},
                                kvm, instances=8)
    assert helped["word"] == "helps" and helped["text"].startswith("carving helps, 8 guests, 2.7x"), helped
    assert "caveat" not in helped and "n=3" in helped["figures"]
    worse = experiment.verdict({"carved": _case(48, 50, 52), "single": _case(95, 100, 105),
                                "no-replica": _case(200, 200, 200)}, kvm)
    assert worse["word"] == "does not help" and worse["carved_over_no_replica"] == 0.25
    tcg = experiment.verdict({"carved": _case(185, 190, 195), "single": _case(68, 70, 72)}, {"h0": "qemu"})
    assert tcg["word"] == "inconclusive" and "measured the emulator" in tcg["text"] and "TCG" in tcg["caveat"]
    assert "no verdict" in experiment.verdict({}, kvm)["text"]
    # A case kept from an earlier run was not interleaved with this one's: no verdict from it.
    kept = experiment.verdict({"carved": _case(185_000, 190_000, 195_000),
                               "single": {**_case(68_000, 70_000, 72_000), "carried_over_from": "2026-11-20"}}, kvm)
    assert kept["word"] == "inconclusive" and "single kept from an earlier run" in kept["text"], kept


def test_the_experiments_symptom_needs_all_three_signs() -> None:
    def breakdown(sessions: int, **shares: float) -> WaitBreakdown:
        full = {c: 0.0 for c in WAIT_CATEGORIES} | {k.replace("_", " "): v for k, v in shares.items()}
        return WaitBreakdown("x", samples=10, sessions=sessions, window_s=60, shares=MappingProxyType(full))

    waits = load.waits_doc({"a": breakdown(30, SyncRep=0.8, CPU=0.2), "b": breakdown(10, SyncRep=0.4, client=0.6)})
    assert waits["sessions"] == 40 and waits["shares"]["SyncRep"] == 0.7, "pooled by observations"
    assert waits["per_target"]["b"]["shares"]["client"] == 0.6
    shows = load.symptom(waits, {"user": 0.2, "system": 0.3, "idle": 0.5})
    assert shows["shows"] is True and "70% of client time in SyncRep" in shows["text"], shows
    busy = load.symptom(waits, {"user": 0.5, "system": 0.45, "idle": 0.05})
    assert busy["shows"] is False and busy["text"] == (
        "the experiment's symptom does not show: CPUs are busy (5% idle, threshold 30%); "
        "kernel time is below user time (45% system vs 50% user)"), busy
    assert load.symptom({"sessions": 0, "shares": {}}, None)["shows"] is None
    assert measure.mean_cpu([None, {"user": 0.2, "system": 0.4, "idle": 0.4}, {"user": 0.4, "system": 0.2, "idle": 0.4}]
                         ) == {"user": 0.3, "system": 0.3, "idle": 0.4}


def test_the_scale_out_summary_holds_the_target_and_the_run_before_a_change(tmp_path: Path) -> None:
    import json

    from bench.summary import _scale_out_before_after

    def doc(*ready: float) -> dict[str, object]:
        return {"started_at": "then", "code": "main at abc1234",
                "steps": [{"added": 1, "from": k, "to": k + 1, "all_ready_s": r} for k, r in enumerate(ready)]}

    assert "NOT met" in _scale_out_before_after(doc(65.0, 93.2), tmp_path / "none.json")[1]
    (tmp_path / "before.json").write_text(json.dumps(doc(109.6, 140.8)))
    lines = _scale_out_before_after(doc(58.0, 93.2), tmp_path / "before.json")
    assert "(target under emulation ≤ 60 s: met)" in lines[1]
    assert lines[3].endswith("main at abc1234): +1 (0→1) 109.6 s → 58.0 s, +1 (1→2) 140.8 s → 93.2 s.")
