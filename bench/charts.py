"""The PNG chart of each part (matplotlib, a dev dependency; without it the JSON and summary are
still written)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import EXPERIMENT_CASES, TARGET_GET_P99_MS, TARGET_PLANNER_MS, TARGET_RECONCILE_S, log


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
