"""The experiment's cases (boot guests): carved, single, multi-instance, no-replica (and the older
multi-process approximation) on fresh guests, the insert-only pgbench load of ../shared/seeds on
each, repeated and interleaved (every case once per round, the order rotated each round), and a
verdict that knows its noise. Writes experiment.json (and .png)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgcarve.advice.cases import CASE_DOC, LoadParams, summarize_runs, with_size
from pgcarve.advice.rounds import CaseGroup, run_rounds
from pgcarve.advice.verdict import EMULATION_CAVEAT, decide_from_cases, ratios, runs_of
from pgcarve.advice.versions import host_versions
from pgcarve.control.fleet import Fleet
from pgcarve.control.state_check import prepare_state
from pgcarve.guest.image import LocalImage
from pgcarve.settings import Paths

from bench.charts import chart_experiment, save_chart
from bench.guests import guest_hosts, prepare_hosts, progress_logger
from bench.harness import BENCH_FLEET_PREFIX, finish, log, run_meta, write_json

__all__ = ["CASE_DOC", "ExperimentParams", "experiment", "summarize_runs", "verdict"]


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
    # Runs of every case, interleaved: below verdict.MIN_REPEATS the verdict is always inconclusive.
    repeats: int = 3

    @property
    def load(self) -> LoadParams:
        return LoadParams(clients=self.clients, threads=self.threads, seconds=self.seconds,
                          sampling_rate=self.sampling_rate, clients_per_target=self.clients_per_target,
                          pg_settings=self.pg_settings)


def verdict(results: dict[str, dict[str, Any]], domain_types: dict[str, str], instances: int = 2,
            vcpus: int = 1) -> dict[str, Any]:
    """pgcarve.advice.verdict's decision on carved (N guests) against single (one instance with
    all the vCPUs), with the other cases' ratios; inconclusive when either was kept from an
    earlier run (not interleaved with this one's)."""
    emulated = any(t != "kvm" for t in domain_types.values())
    carved = results.get("carved")
    out: dict[str, Any] = ratios(runs_of(carved) if carved else None,
                                 {f"carved_over_{other.replace('-', '_')}": runs_of(results[other])
                                  for other in ("single", "no-replica", "multi-instance", "multi-process")
                                  if other in results})
    if emulated:
        out["caveat"] = EMULATION_CAVEAT
    carried = [case for case in ("carved", "single") if "carried_over_from" in results.get(case, {})]
    if carried:
        # Runs from another session were not interleaved with this one's: a drift of the machine
        # between the two sessions would show as a difference.
        out["word"] = "inconclusive"
        out["text"] = (f"inconclusive: {' and '.join(carried)} kept from an earlier run; run carved and single "
                       "together for a verdict")
        return out
    decided = decide_from_cases({instances: carved} if carved else {}, results.get("single"), vcpus, emulated,
                                results.get("multi-instance"))
    out.update(word=decided.word, text=decided.text, headline=decided.headline, reason=decided.reason,
               figures=decided.figures)
    return out


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
                                      "repeats": params.repeats,
                                      "pg_settings": params.pg_settings,
                                      "clients": "per instance/table" if params.clients_per_target
                                      else "split over the instances/tables",
                                      "pgbench": "pgbench -M prepared -n -r -P 1 -l -f insert.sql -c C -j J -T S"},
                           "versions": {"host": host_versions(), "image": LocalImage(paths.image_dir).versions()}}
    results: dict[str, dict[str, Any]] = {}
    doc["cases"] = results
    logdir = Path(tempfile.mkdtemp(prefix="pgcarve-bench-logs-"))
    try:
        with guest_hosts(paths, hosts, hosts_file, doc) as base:
            base = with_size(base, standbys=params.standbys, memory_mib=params.memory_mib)
            probe_fleet = Fleet(base, paths)
            try:
                prepare_state(probe_fleet)  # as `pgcarve up` does: a new fleet's secrets, never new ones over guests
                doc["prepare"] = prepare_hosts(probe_fleet)
                doc["versions"]["libvirt"] = probe_fleet.hosts[base.hosts[0].name].versions()
            finally:
                probe_fleet.close()
            domain_types = doc["prepare"]["domain_type"]
            v = params.vcpus or (base.instance.vcpus if hosts_file is not None else 1)
            doc["params"]["vcpus_per_carved_instance_V"] = v
            doc["params"]["vcpus_single_instance"] = v * params.instances
            # Every round names its fleets afresh (advice.cases.case_fleet).
            n = params.instances
            groups: list[CaseGroup] = []
            if "carved" in cases:
                groups.append(CaseGroup("c", with_size(base, vcpus=v), n, n, (("carved", "carved"),)))
            together = tuple((c, c) for c in ("single", "multi-process") if c in cases)
            if together:
                groups.append(CaseGroup("s", with_size(base, vcpus=v * n), 1, n, together))
            if "multi-instance" in cases:
                groups.append(CaseGroup("m", with_size(base, vcpus=v * n, clusters=n), 1, n,
                                        (("multi-instance", "multi-instance"),)))
            if "no-replica" in cases:
                groups.append(CaseGroup("n", with_size(base, vcpus=v * n, standbys=0, synchronous_commit="local"),
                                        1, n, (("no-replica", "no-replica"),)))
            found = run_rounds(groups, paths, params.repeats, params.load, logdir, BENCH_FLEET_PREFIX, say=log,
                               progress=progress_logger("  "))
            if found.guest:
                doc["versions"]["guest"] = found.guest
            for case, case_runs in found.runs.items():
                results[case] = summarize_runs(case_runs)
            if out is not None:
                carry_over(out / "experiment.json", doc)
            doc["verdict"] = verdict(results, domain_types, params.instances, v)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    finish(doc)
    if out is not None:
        write_json(out / "experiment.json", doc)
        if charts:
            save_chart(chart_experiment, doc, out / "experiment.png")
    return doc
