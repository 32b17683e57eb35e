"""`pgcarve advise` carried out: the plan's cases on fresh guests (a short ramp first when no
client count is given), repeated and interleaved, everything carved removed again, the host
checked to be as it was, and the verdict (pgcarve.advice.verdict) over the results."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pgcarve.advice.cases import (
    CARVED,
    MULTI_INSTANCE,
    SINGLE,
    LoadParams,
    Say,
    case_fleet,
    instances_up,
    summarize_runs,
    with_size,
)
from pgcarve.advice.host_state import HostState, differences, host_state
from pgcarve.advice.plan import RAMP_CLIENTS, RAMP_SECONDS, AdvicePlan
from pgcarve.advice.rounds import CaseGroup, Step, run_rounds
from pgcarve.advice.verdict import decide_from_cases
from pgcarve.advice.versions import host_versions
from pgcarve.control.fleet import Fleet, Progress, no_progress
from pgcarve.guest.image import LocalImage
from pgcarve.postgres.pgbench import INSERT_SCRIPT, run_pgbench
from pgcarve.settings import Paths

FLEET_PREFIX = "pgca"  # + a case's kind + 4 hex: never an operator's fleet name
RAMP_GAIN = 1.05  # a client count that adds less than 5 % TPS over the one before it saturates


def pgbench_threads(clients: int) -> int:
    """pgbench threads: one per client up to this machine's CPUs."""
    return max(1, min(clients, os.cpu_count() or 1))


def ramp(fleet: Fleet, say: Say = lambda _m: None) -> tuple[int, list[dict[str, float]]]:
    """The smallest client count of RAMP_CLIENTS after which more clients add under 5 % TPS, on
    `fleet`'s first primary; with every step's figures."""
    primary = next(i.primary for i in fleet.observe() if i.primary and i.primary.endpoint)
    steps: list[dict[str, float]] = []
    best_clients, best_tps = RAMP_CLIENTS[0], 0.0
    for clients in RAMP_CLIENTS:
        result = run_pgbench(primary.name, primary.endpoint, fleet.credentials.admin_password, clients,
                             pgbench_threads(clients), RAMP_SECONDS, script=INSERT_SCRIPT, tls=fleet.client_tls)
        steps.append({"clients": clients, "tps": round(result.tps, 1)})
        say(f"ramp: {clients} client(s): {result.tps:,.0f} TPS")
        if result.tps < best_tps * RAMP_GAIN:
            break
        best_clients, best_tps = clients, result.tps
    return best_clients, steps


def with_clients(groups: tuple[CaseGroup, ...], clients: int) -> tuple[CaseGroup, ...]:
    """Each case gets `clients` in all, and never fewer than 2 per carved primary or cluster."""
    return tuple(replace(g, clients=max(clients, 2 * g.n if g.cases[0][1] != SINGLE else clients)) for g in groups)


def run_advice(fleet: Fleet, plan: AdvicePlan, say: Say = lambda _m: None,
               step: Step = lambda _d, _t, _w: None, progress: Progress = no_progress) -> dict[str, Any]:
    """Carve, load, remove and decide as `plan` says; the report's document."""
    paths = Paths(fleet.paths.state_dir, Path(plan.image_dir))
    LocalImage(paths.image_dir).check()
    base = plan.groups[0].config
    doc: dict[str, Any] = {"kind": "advice", "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "plan": plan.to_dict(),
                           "versions": {"host": host_versions(), "image": LocalImage(paths.image_dir).versions()}}
    hosts = Fleet(base, paths, boot_timeout_s=fleet.boot_timeout_s)
    logdir = Path(tempfile.mkdtemp(prefix="pgcarve-advice-"))
    t0 = time.monotonic()
    prepared: HostState | None = None
    try:
        untouched = host_state(hosts)
        step(0, 1, "uploading the image and finding the domain type")
        types = {}
        for host in base.hosts:
            hosts.images.on(host.name)
            types[host.name] = hosts.domain_types.of(host.name)
        doc["domain_types"] = types
        doc["versions"]["libvirt"] = hosts.hosts[plan.host].versions()
        prepared = host_state(hosts)
        doc["kept"] = differences(untouched, prepared)  # the uploaded image: reused by the next run
        groups = plan.groups
        if plan.clients is None:
            single = next(g for g in groups if g.cases[0][1] == SINGLE)
            record: dict[str, Any] = {}
            step(0, 1, f"ramp: creating one instance of {single.config.instance.vcpus} vCPU")
            ramp_config = with_size(single.config, fleet=case_fleet(FLEET_PREFIX, "r"))
            with instances_up(ramp_config, paths, 1, record, progress, fleet.boot_timeout_s) as ramp_fleet:
                clients, steps = ramp(ramp_fleet, say)
            doc["ramp"] = {"steps": steps, "clients": clients, "boot_s": record.get("boot_s")}
        else:
            clients = plan.clients
        groups = with_clients(groups, clients)
        params = LoadParams(clients=clients, threads=pgbench_threads(clients), seconds=plan.seconds,
                            sampling_rate=1.0 if "qemu" in types.values() else 0.05)
        doc["load"] = {"clients": clients, "threads": params.threads, "seconds": plan.seconds,
                       "sampling_rate": params.sampling_rate,
                       "clients_per_case": {g.label: g.clients for g in groups},
                       "pgbench": "pgbench -M prepared -n -r -P 1 -l -f insert.sql -c C -j J -T S",
                       "script": INSERT_SCRIPT.strip()}
        found = run_rounds(groups, paths, plan.repeat, params, logdir, FLEET_PREFIX, say, step, progress,
                           fleet.boot_timeout_s)
        if found.guest:
            doc["versions"]["guest"] = found.guest
        cases = {key: summarize_runs(runs) for key, runs in found.runs.items()}
        doc["cases"] = cases
        emulated = any(t != "kvm" for t in types.values())
        verdict = decide_from_cases({n: cases[f"{CARVED}-{n}"] for n in plan.ns if f"{CARVED}-{n}" in cases},
                                    cases.get(SINGLE), plan.vcpus, emulated, cases.get(MULTI_INSTANCE),
                                    plan.single_vcpus, plan.clusters)
        doc["verdict"] = verdict.to_dict()
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
        left = differences(prepared, host_state(hosts)) if prepared is not None else []
        doc["left_behind"] = left
        doc["host_left_as_it_was"] = not left
        doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        doc["wall_s"] = round(time.monotonic() - t0, 1)
        hosts.close()
    return doc

