"""Every case repeated and interleaved: each round runs every group of cases once, the order
rotated each round, so a slow drift of the machine (or one case always running first on cold
caches) does not favour one case. One group failing still leaves the others' results."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pgcarve.advice.cases import (
    CASE_DOC,
    NO_REPLICA,
    LoadParams,
    Say,
    case_fleet,
    instances_up,
    run_case,
    with_size,
)
from pgcarve.advice.load import guest_facts
from pgcarve.config import FleetConfig
from pgcarve.control.fleet import Progress, no_progress
from pgcarve.settings import Paths


@dataclass(frozen=True)
class CaseGroup:
    """Cases that share one fleet: `instances` instances of `config`, loaded as each of `cases`
    ((result key, case name) pairs) in turn; `n` is the N the cases stand for."""

    kind: str  # a few letters in the fleet's name
    config: FleetConfig
    instances: int
    n: int
    cases: tuple[tuple[str, str], ...]
    clients: int | None = None  # total pgbench clients of these cases (default: the LoadParams')

    @property
    def label(self) -> str:
        return "/".join(key for key, _ in self.cases)


# (runs finished so far, runs in all, what runs now)
Step = Callable[[int, int, str], None]


@dataclass
class RoundsResult:
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # result key -> every run
    guest: dict[str, str] = field(default_factory=dict)  # PostgreSQL and kernel of the first guest

    def recorded(self) -> int:
        """Runs recorded so far, measured or failed."""
        return sum(len(runs) for runs in self.runs.values())


def run_rounds(groups: Sequence[CaseGroup], paths: Paths, repeats: int, params: LoadParams, logdir: Path,
               fleet_prefix: str, say: Say = lambda _m: None, step: Step = lambda _d, _t, _w: None,
               progress: Progress = no_progress, boot_timeout_s: float = 600.0) -> RoundsResult:
    """Every group's cases `repeats` times, interleaved; each group's fleet made afresh per round
    (a new fleet name each time, see case_fleet) and removed after its cases."""
    found = RoundsResult()
    total = repeats * sum(len(g.cases) for g in groups)
    for round_no in range(repeats):
        shift = round_no % len(groups) if groups else 0
        for group in [*groups[shift:], *groups[:shift]]:
            finished: set[str] = set()
            for attempt in (1, 2):  # a case whose guests did not come up is tried once more
                try:
                    _run_group(group, round_no, repeats, paths, params, logdir, fleet_prefix, say, step,
                               progress, boot_timeout_s, found, finished, total)
                    break
                except Exception as exc:  # one group failing still leaves the others' results
                    if attempt == 1:
                        say(f"{group.label} failed: {exc}; trying it once more, on new guests")
                        continue
                    for key, case in group.cases:
                        if key not in finished:
                            found.runs.setdefault(key, []).append({"case": case, "how": CASE_DOC[case], "n": group.n,
                                                                   "error": str(exc), "round": round_no + 1})
                    say(f"{group.label} failed again: {exc}")
    step(found.recorded(), total, "done")
    return found


def _run_group(group: CaseGroup, round_no: int, repeats: int, paths: Paths, params: LoadParams, logdir: Path,
               fleet_prefix: str, say: Say, step: Step, progress: Progress, boot_timeout_s: float,
               found: RoundsResult, finished: set[str], total: int) -> None:
    """The group's cases not `finished` yet, on a fleet made for them (a new fleet name) and removed
    after; each finished case is added to `finished` and `found`."""
    config = with_size(group.config, fleet=case_fleet(fleet_prefix, group.kind))
    record: dict[str, Any] = {}
    step(found.recorded(), total, f"round {round_no + 1}/{repeats}: {group.label}, creating {group.instances} "
                      f"instance(s) of {config.instance.vcpus} vCPU")
    say(f"round {round_no + 1}/{repeats}, {group.label}: creating {group.instances} instance(s) of "
        f"{config.instance.vcpus} vCPU, {config.replication.standbys} standby(s)")
    load = params if group.clients is None else replace(
        params, clients=group.clients, threads=min(params.threads, group.clients))
    with instances_up(config, paths, group.instances, record, progress, boot_timeout_s) as fleet:
        if not found.guest:
            first = next(i.primary for i in fleet.observe() if i.primary)
            found.guest = guest_facts(fleet, first)
        for key, case in group.cases:
            if key in finished:
                continue
            step(found.recorded(), total, f"round {round_no + 1}/{repeats}: {key}, pgbench {load.seconds} s")
            settings = dict(load.pg_settings)
            if case == NO_REPLICA:
                settings.setdefault("synchronous_commit", "local")
            result = run_case(case, fleet, group.n, load, settings, logdir, say)
            result.update(boot_s=record.get("boot_s"), fleet=config.fleet, round=round_no + 1,
                          n=group.n, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            found.runs.setdefault(key, []).append(result)
            finished.add(key)
