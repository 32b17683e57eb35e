"""The verdict, pure: from the TPS of every run of every case, and what the single instance
waited on, whether carving helps on this host, into how many guests, and why.

"helps" and "does not help" need every run of the recommended carving to beat (or lose to) every
run of the single instance with all the vCPUs, over at least MIN_REPEATS interleaved runs each;
otherwise the difference is within what the host does from one run to the next, and the verdict
is "inconclusive". Under emulation (QEMU TCG) it is always inconclusive: the figures measured the
emulator, not the kernel locks carving is about.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

MIN_REPEATS = 3  # fewer runs of a case than this cannot show its spread

# The experiment's symptom in the single instance: commits mostly wait for the standby, the CPUs
# sit idle, and the kernel's share of busy time is at least user space's (mutexes behind epoll_ctl).
SYNCREP_SHARE = 0.5
IDLE_SHARE = 0.3
BUSY_IDLE_SHARE = 0.1  # below this idle share the instance is CPU-bound
INSTANCE_WAITS = ("WAL insert", "WAL write", "other LWLocks")

EMULATION_CAVEAT = ("the guests ran under QEMU TCG (software emulation, no usable KVM): the figures measure the "
                    "emulator, not the kernel locks carving is about; rerun on a KVM host")

Word = Literal["helps", "does not help", "inconclusive", "none"]


@dataclass(frozen=True)
class Runs:
    """Every run's aggregate TPS of one case."""

    tps: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.tps))

    @property
    def low(self) -> float:
        return min(self.tps)

    @property
    def high(self) -> float:
        return max(self.tps)

    def above(self, other: Runs) -> bool:
        """Every run of this case beat every run of `other`."""
        return self.low > other.high

    def overlaps(self, other: Runs) -> bool:
        return self.low <= other.high and other.low <= self.high

    def describe(self) -> str:
        if len(self.tps) == 1:
            return f"{self.median:,.0f} TPS (1 run)"
        return f"median {self.median:,.0f} TPS (runs {self.low:,.0f}-{self.high:,.0f}, n={len(self.tps)})"


def runs_of(case: Mapping[str, Any]) -> Runs | None:
    """A case's runs from its summarized result (runs_tps, else aggregate_tps); None if it failed."""
    tps = case.get("runs_tps") or ([case["aggregate_tps"]] if case.get("aggregate_tps") else [])
    return Runs(tuple(float(t) for t in tps)) if tps else None


@dataclass(frozen=True)
class Evidence:
    """What the single instance (all the vCPUs, one kernel) showed: the share of its client
    sessions' time in each wait category, and its guest's CPU split (user/system/idle, 0..1)."""

    waits: Mapping[str, float]
    cpu: Mapping[str, float] | None

    @classmethod
    def of(cls, case: Mapping[str, Any]) -> Evidence | None:
        """From a case's result (run_load's "waits" and the mean of its guests' CPU splits)."""
        waits = case.get("waits") or {}
        if not waits.get("sessions"):
            return None
        splits = [c for c in (case.get("guest_cpu") or {}).values() if c]
        cpu = ({k: sum(c[k] for c in splits) / len(splits) for k in ("user", "system", "idle")} if splits
               else case.get("host_cpu"))
        return cls(waits=dict(waits.get("shares", {})), cpu=cpu)

    @property
    def top(self) -> str | None:
        return max(self.waits, key=lambda c: self.waits[c]) if self.waits else None


@dataclass(frozen=True)
class Verdict:
    word: Word
    headline: str  # e.g. "carving helps, 8 guests, 2.7x"
    reason: str  # one sentence from the evidence
    figures: str  # the runs the verdict stands on
    recommended_instances: int | None = None  # N to carve into (1: do not carve)
    vcpus_per_guest: int | None = None
    gain: float | None = None  # TPS of the recommended N over the single instance's
    beyond_noise: bool = False
    best_instances: int | None = None  # N with the highest median, whatever the noise
    caveat: str | None = None

    @property
    def text(self) -> str:
        return f"{self.headline}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.text}


def _pct(share: float) -> str:
    return f"{share * 100:.0f} %"


def evidence_clause(evidence: Evidence | None) -> str:
    """What the single instance's waits and CPU say about where its wall is."""
    if evidence is None or evidence.top is None:
        return "no wait samples were recorded for the single instance, so the cause is not measured"
    top, waits, cpu = evidence.top, evidence.waits, evidence.cpu
    syncrep = waits.get("SyncRep", 0.0)
    if cpu is not None and cpu["idle"] < BUSY_IDLE_SHARE:
        return (f"the single instance keeps its CPUs busy ({_pct(cpu['idle'])} idle, mostly {top}): "
                "it is CPU-bound")
    if cpu is not None and syncrep >= SYNCREP_SHARE and cpu["idle"] >= IDLE_SHARE and cpu["system"] >= cpu["user"]:
        return (f"the single instance waits on SyncRep ({_pct(syncrep)} of session time) with "
                f"{_pct(cpu['idle'])} idle CPU and kernel time above user time "
                f"({_pct(cpu['system'])} vs {_pct(cpu['user'])}): the wall is in the shared kernel")
    if top in INSTANCE_WAITS:
        return (f"the single instance waits mostly on {top} ({_pct(waits[top])} of session time): "
                "the wall is inside the one PostgreSQL instance")
    if top == "SyncRep":
        idle = f" with {_pct(cpu['idle'])} idle CPU" if cpu is not None else ""
        return (f"the single instance waits mostly on its synchronous standby (SyncRep {_pct(syncrep)}){idle} "
                "but without the kernel's signs: look at the round trip to the standby hosts")
    if top == "client":
        return (f"the single instance's sessions wait mostly for their clients ({_pct(waits[top])}): "
                "the load did not saturate it, raise --clients")
    return f"the single instance waits mostly on {top} ({_pct(waits[top])} of session time)"


def decide(carved: Mapping[int, Runs], single: Runs | None, vcpus: int = 1, emulated: bool = False,
           multi_instance: Runs | None = None, evidence: Evidence | None = None,
           single_vcpus: int | None = None, clusters: int | None = None) -> Verdict:
    """The verdict from `carved` (runs per N guests of `vcpus` vCPUs each) against `single` (one
    instance with all the vCPUs: `single_vcpus`, default the largest N's) and `multi_instance`
    (`clusters` PostgreSQL clusters in one guest, default the largest N). The recommended N is
    the smallest whose runs reach the best N's (more guests for the same TPS only cost memory
    and standbys)."""
    if not carved or single is None:
        return Verdict("none", "no verdict", "it needs both carved runs and the single instance's",
                       figures="", caveat=EMULATION_CAVEAT if emulated else None)
    best_n = max(carved, key=lambda n: (carved[n].median, -n))
    single_vcpus = single_vcpus or max(carved) * vcpus
    clusters = clusters or max(carved)
    best = carved[best_n]
    # The smallest N within the noise of the best that still beats the single instance; one guest
    # of V vCPUs is no carving, so it never stands in for a best N above 1.
    rec_n = min((n for n, runs in carved.items()
                 if n == best_n or (n > 1 and runs.overlaps(best) and runs.above(single))), default=best_n)
    rec = carved[rec_n]
    gain = rec.median / single.median if single.median else None
    figures = (f"{rec_n} guest(s) of {vcpus} vCPU: {rec.describe()}; one instance of {single_vcpus} vCPUs: "
               f"{single.describe()}")
    if multi_instance is not None:
        figures += f"; {clusters} clusters in one guest: {multi_instance.describe()}"
    clause = evidence_clause(evidence)
    base = Verdict("inconclusive", "", "", figures, vcpus_per_guest=vcpus, gain=round(gain, 3) if gain else None,
                   best_instances=best_n, caveat=EMULATION_CAVEAT if emulated else None)
    ratio = f"{gain:.1f}x" if gain else "n/a"
    if emulated:
        return replace(base, headline="inconclusive: the guests ran under emulation",
                       reason=f"{clause}, but under QEMU TCG that measured the emulator, not this host's kernel")
    if min(len(rec.tps), len(single.tps)) < MIN_REPEATS:
        return replace(base, headline=f"inconclusive: fewer than {MIN_REPEATS} runs of each case cannot show the noise",
                       reason=f"{clause}; rerun with --repeat {MIN_REPEATS} or more")
    if rec.above(single) and rec_n == 1:
        return replace(base, word="does not help",
                       headline=f"carving does not help: one guest of {vcpus} vCPU(s) is best, {ratio} over one "
                                f"with all {single_vcpus}", reason=f"{clause}; more guests do not add to it",
                       recommended_instances=1, beyond_noise=True)
    if rec.above(single):
        return replace(base, word="helps", headline=f"carving helps, {rec_n} guests, {ratio}",
                       reason=f"{clause}; {_helps_tail(rec_n, rec, single, multi_instance, clusters)}",
                       recommended_instances=rec_n, beyond_noise=True)
    if single.above(best):
        return replace(base, word="does not help",
                       headline=f"carving does not help: one instance with all {single_vcpus} vCPUs is best "
                                f"(the best carving, {best_n} guests, reached {best.median / single.median:.1f}x)",
                       reason=f"{clause}; carving does not remove it", recommended_instances=1, beyond_noise=True)
    return replace(base, headline=f"inconclusive: {best_n} guests vs one instance, {ratio}, within the noise",
                   reason=f"{clause}; the runs overlap, so whether carving removes it is not settled: raise "
                          "--seconds or --repeat")


def _helps_tail(n: int, rec: Runs, single: Runs, multi_instance: Runs | None, clusters: int) -> str:
    if multi_instance is None:
        return f"carving into {n} removes it"
    if multi_instance.above(single) and not rec.above(multi_instance):
        return (f"{clusters} clusters in one guest do as well as {n} guests, so the wall is per PostgreSQL instance, "
                f"not per kernel: carving into {n} removes it, and so would {clusters} clusters in one kernel")
    return f"{clusters} clusters in one kernel do not reach {n} guests: carving into {n} removes it"


def decide_from_cases(carved: Mapping[int, Mapping[str, Any]], single: Mapping[str, Any] | None, vcpus: int,
                      emulated: bool, multi_instance: Mapping[str, Any] | None = None,
                      single_vcpus: int | None = None, clusters: int | None = None) -> Verdict:
    """decide() on summarized case results (cases.summarize_runs); failed cases are left out."""
    carved_runs = {n: r for n, case in carved.items() if (r := runs_of(case)) is not None}
    return decide(carved_runs, runs_of(single) if single else None, vcpus, emulated,
                  runs_of(multi_instance) if multi_instance else None,
                  Evidence.of(single) if single else None, single_vcpus, clusters)


def ratios(base: Runs | None, others: Mapping[str, Runs | None]) -> dict[str, float]:
    """base's median over each other case's median, under each other case's key."""
    if base is None:
        return {}
    return {name: round(base.median / runs.median, 3) for name, runs in others.items() if runs and runs.median}
