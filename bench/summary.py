"""summary.md: one Markdown page rebuilt from every part's JSON found in the results directory,
so parts run separately still end up in one summary."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pgcarve.postgres.pgbench import INSERT_SCRIPT
from pgcarve.postgres.statistics import WAIT_CATEGORIES

from bench.harness import EXPERIMENT_CASES, TARGET_GET_P99_MS, TARGET_PLANNER_MS, TARGET_RECONCILE_S

SCALE_OUT_TARGET_S = 60.0  # +1 writable with its synchronous standby, under emulation (issue 16)


def _scale_out_before_after(so: dict[str, Any], before_path: Path) -> list[str]:
    """The first +1 against its target, and each step against `scale-out-before.json` when kept:
    the same command's output on the code before a change, on the same machine."""
    steps = so.get("steps", [])
    if not steps:
        return []
    first = steps[0]["all_ready_s"]
    lines = ["", f"First +1 writable with its synchronous standby in {first:.1f} s (target under emulation "
                 f"≤ {SCALE_OUT_TARGET_S:.0f} s: {'met' if first <= SCALE_OUT_TARGET_S else 'NOT met'})."]
    if before_path.exists():
        before = json.loads(before_path.read_text())
        pairs = ", ".join(f"+{a['added']} ({a['from']}→{a['to']}) {b['all_ready_s']:.1f} s → {a['all_ready_s']:.1f} s"
                          for a, b in zip(steps, before.get("steps", []), strict=False))
        lines += ["", f"Before and after, the same command on the same machine (`{before_path.name}`, "
                      f"{before['started_at']}: {before.get('code', 'the code before')}): {pairs}."]
    return lines

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


def image_versions(image: dict[str, str]) -> str:
    """The guest image's build (its versions.env), or nothing for a run that did not record it."""
    if not image:
        return ""
    return (f"image Debian {image.get('release', '?')} {image.get('debian', '')}".rstrip()
            + f" (kernel {image.get('kernel', '?')}, PostgreSQL {image.get('postgresql', '?')}, "
            f"Patroni {image.get('patroni', 'n/a')}, pgBackRest {image.get('pgbackrest', 'n/a')}); ")


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
                  f"{cp['machine']['kernel']}, load average at start {cp['machine']['loadavg_at_start']}"
                  + (f", CPU pressure (PSI some avg60) {cp['machine']['cpu_pressure_at_start']}% at start, "
                     f"{cp['machine'].get('cpu_pressure_at_end')}% at end"
                     if cp["machine"].get("cpu_pressure_at_start") is not None else "") + ".",
                  f"Hosts: {setup['hosts']} x ({setup['host_topology']}) on `{setup['libvirt_uri']}`; instance: "
                  f"{setup['instance']}; capacity {setup['fleet_capacity']}; libvirt {setup['libvirt']}.", "",
                  "| measure | result | target |", "|---|---|---|",
                  f"| reconcile 0 → {n} (plan + overlay + DomainSpec + define + start, {setup['parallel_workers']} "
                  f"workers) | {rec['wall_s']:.2f} s{_mark(rec['meets_target'])} | ≤ {TARGET_RECONCILE_S:.0f} s |"]
        for g in cp["get_instances"]:
            over = f" over {g['wall_s']:.1f} s" if "wall_s" in g else ""
            lines.append(f"| GET /v1/instances at {n}, {int(g['count'])} requests{over}, {g['transport']}, "
                         f"{g.get('variant', '?')} | p50 "
                         f"{g['p50_ms']:.1f} ms, p99 {g['p99_ms']:.1f} ms{_mark(g['p99_ms'] <= TARGET_GET_P99_MS)} "
                         f"| p99 ≤ {TARGET_GET_P99_MS:.0f} ms |")
        pl = cp["planner"]
        if "vcpus_1" in pl:
            lines.append(f"| planner, {pl['host_cpus']} CPUs / {pl['numa_nodes']} nodes, {pl['vcpus_1']['instances']} "
                         f"instances | p50 {pl['vcpus_1']['p50_ms']:.2f} ms (best {pl['vcpus_1']['best_ms']:.2f})"
                         f"{_mark(pl['meets_target'])} | ≤ {TARGET_PLANNER_MS:.0f} ms |")
        sp_row = cp.get("scaler_path", {})
        if "scale_up_target_s" in sp_row:
            lines.append(f"| whole Scaler path {sp_row['scale_up_from']} → {n} on {setup['hosts']} hosts, guest waits "
                         f"stubbed | {sp_row['scale_up_s']:.2f} s{_mark(sp_row['scale_up_meets_target'])} | "
                         f"≤ {sp_row['scale_up_target_s']:.0f} s |")
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
            start = sp.get("scale_up_from", 0)
            target = sp.get("scale_up_target_s")
            said = ([f"{'meets' if sp['scale_up_meets_target'] else '**misses**'} its target of ≤ {target:.0f} s"]
                    if target is not None else [])
            said += [f"{sp['scale_up_cpu_s']:.1f} s of this process's CPU"] if "scale_up_cpu_s" in sp else []
            verdict = f" ({'; '.join(said)})" if said else ""
            lines += ["", "Whole `Scaler`/`Provisioner.create_instance` path, guest waits stubbed: "
                      f"scale {start} → {n} {sp['scale_up_s']:.1f} s{verdict}, {n} → 0 {sp['scale_down_s']:.1f} s, "
                      f"purging the {n} retired {sp['purge_retired_s']:.1f} s. Includes: "
                      f"{sp['scale_up_includes']}. Stubbed: {sp['stubbed']}. For scale: one seed ISO build "
                      f"takes {sp.get('seed_iso_build_ms_p50', '?')} ms and one full observe() at {n} instances "
                      f"{sp.get('observe_at_n_ms', '?')} ms."]
            if "plus_one_s" in sp:
                met = "met" if sp["meets_plus_targets"] else "NOT met"
                boot = sp.get("modeled_boot_s")
                lines += ["", (f"From an empty fleet, each guest's wait for PostgreSQL standing in for a {boot:.0f} s "
                               "boot: " if boot else "From an empty fleet: ")
                          + f"+1 took {sp['plus_one_s']:.2f} s, then +4 at once {sp['plus_four_s']:.2f} s "
                          f"({sp['plus_four_over_plus_one']}x"
                          + (f"; control plane {sp['control_plane_per_instance_s']:.2f} s per instance" if boot else "")
                          + f"; targets: at most 1 s per instance, +4 within 1.5x of +1: {met})."]
                if "bare_plus_one_s" in sp:
                    lines += ["", f"With no boot at all, +1 took {sp['bare_plus_one_s']:.3f} s and +4 "
                              f"{sp['bare_plus_four_s']:.3f} s: Python work under one interpreter lock, which the "
                              "boots it overlaps with hide."]
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
        lines += _scale_out_before_after(so, out / "scale-out-before.json")
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
        lines += ["", "| case | median TPS | runs (TPS, in order) | per instance TPS (the run nearest the median) | "
                  "p50 ms | p99 ms | host CPU user/system | guest CPU user/system | how |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for case in EXPERIMENT_CASES:
            r = ex["cases"].get(case)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {case} | failed: {r['error'][:120]} | | | | | | | {r['how']} |")
                continue
            per = ", ".join(f"{q['tps']:.0f}" for q in r["per_instance"])
            cpu = r["host_cpu"]
            guests = [g for g in (r.get("guest_cpu") or {}).values() if g]
            guest_cpu = (f"{statistics.fmean(g['user'] for g in guests) * 100:.0f}% / "
                         f"{statistics.fmean(g['system'] for g in guests) * 100:.0f}%") if guests else "n/a"
            mark = (" (approx.)" if r.get("approximation") else "") + (
                f" (run of {r['carried_over_from']})" if r.get("carried_over_from") else "")
            tps_runs = ", ".join(f"{t:.0f}" for t in r.get("runs_tps", [r["aggregate_tps"]]))
            spread = f" (spread {r['spread'] * 100:.0f}%)" if r.get("spread") is not None else ""
            lines.append(f"| {case}{mark} | {r['aggregate_tps']:.0f} | {tps_runs}{spread} | "
                         f"{per} | {r['latency_p50_ms']:.2f} | {r['latency_p99_ms']:.2f} | "
                         f"{cpu['user'] * 100:.0f}% / {cpu['system'] * 100:.0f}% | {guest_cpu} | {r['how']} |")
        waited = [(case, ex["cases"][case]) for case in EXPERIMENT_CASES
                  if case in ex["cases"] and "waits" in ex["cases"][case]]
        if waited:
            shown = WAIT_CATEGORIES  # every category, so that each row adds up to 100%
            lines += ["", "What client sessions waited on (share of `pg_stat_activity` samples, about 10 a second "
                      "on every primary; the run nearest the median):", "",
                      "| case | " + " | ".join(shown) + " | the experiment's symptom |",
                      "|---|" + "---|" * (len(shown) + 1)]
            for case, r in waited:
                shares = r["waits"]["shares"]
                lines.append(f"| {case} | " + " | ".join(f"{shares.get(c, 0) * 100:.0f}%" for c in shown)
                             + f" | {r.get('symptom', {}).get('text', 'n/a')} |")
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
                  + image_versions(vers.get("image", {})) +
                  f"domain type {ex.get('prepare', {}).get('domain_type')}.", "",
                  "![experiment](experiment.png)", ""]
    if len(lines) <= 4:
        lines.append("No results yet: run `make bench`.")
    return "\n".join(lines) + "\n"


def write_summary(out: Path) -> Path:
    path = out / "summary.md"
    path.write_text(summary_markdown(out))
    return path
