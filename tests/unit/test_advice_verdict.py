"""The advisor's verdict on recorded figures (pgcarve.advice.verdict): a clear gain, a gain within
the noise, a loss, emulation, and the experiment's own numbers."""

from __future__ import annotations

from pgcarve.advice.cases import summarize_runs
from pgcarve.advice.verdict import MIN_REPEATS, Evidence, Runs, decide, decide_from_cases, evidence_clause

# The experiment's single instance: SyncRep with idle CPUs and kernel time above user time.
KERNEL_WALL = Evidence(waits={"SyncRep": 0.62, "CPU": 0.2, "client": 0.18},
                       cpu={"user": 0.12, "system": 0.28, "idle": 0.6})


def runs(*tps: float) -> Runs:
    return Runs(tps)


def test_the_experiments_own_numbers() -> None:
    """70K single, 190K for eight guests (three runs each, a few percent apart)."""
    carved = {1: runs(9_800, 10_000, 10_300), 2: runs(47_000, 49_000, 50_000), 4: runs(101_000, 104_000, 106_000),
              8: runs(186_000, 190_000, 193_000)}
    v = decide(carved, runs(68_500, 70_000, 71_200), vcpus=8, evidence=KERNEL_WALL)
    assert v.headline == "carving helps, 8 guests, 2.7x", v
    assert v.word == "helps" and v.recommended_instances == 8 and v.vcpus_per_guest == 8 and v.beyond_noise
    assert v.reason == ("the single instance waits on SyncRep (62 % of session time) with 60 % idle CPU and kernel "
                        "time above user time (28 % vs 12 %): the wall is in the shared kernel; carving into 8 "
                        "removes it")
    assert "one instance of 64 vCPUs: median 70,000 TPS (runs 68,500-71,200, n=3)" in v.figures
    assert v.caveat is None


def test_the_smallest_n_within_the_noise_of_the_best_is_recommended() -> None:
    carved = {2: runs(120, 125, 130), 4: runs(180, 190, 200), 8: runs(185, 195, 205)}
    v = decide(carved, runs(95, 100, 105))
    assert v.word == "helps" and v.best_instances == 8 and v.recommended_instances == 4
    assert v.headline == "carving helps, 4 guests, 1.9x"


def test_a_gain_within_the_noise_is_inconclusive() -> None:
    v = decide({2: runs(80, 120, 160)}, runs(70, 100, 130), evidence=KERNEL_WALL)
    assert v.word == "inconclusive" and v.recommended_instances is None and not v.beyond_noise
    assert v.headline == "inconclusive: 2 guests vs one instance, 1.2x, within the noise"
    assert "the runs overlap" in v.reason


def test_a_loss_says_one_instance_is_best() -> None:
    busy = Evidence(waits={"CPU": 0.7, "WAL insert": 0.2, "client": 0.1}, cpu={"user": 0.7, "system": 0.25,
                                                                              "idle": 0.05})
    v = decide({2: runs(48, 50, 52), 4: runs(60, 61, 63)}, runs(95, 100, 105), vcpus=2, evidence=busy)
    assert v.word == "does not help" and v.recommended_instances == 1
    assert v.headline == ("carving does not help: one instance with all 8 vCPUs is best (the best carving, 4 guests, "
                          "reached 0.6x)")
    assert v.reason == ("the single instance keeps its CPUs busy (5 % idle, mostly CPU): it is CPU-bound; carving "
                        "does not remove it")


def test_emulation_is_always_inconclusive_and_says_so() -> None:
    v = decide({2: runs(185, 190, 195)}, runs(68, 70, 72), emulated=True, evidence=KERNEL_WALL)
    assert v.word == "inconclusive" and v.headline == "inconclusive: the guests ran under emulation"
    assert "QEMU TCG" in (v.caveat or "") and "measured the emulator" in v.reason
    assert v.recommended_instances is None


def test_too_few_repeats_cannot_show_the_noise() -> None:
    v = decide({8: runs(190_000)}, runs(70_000))
    assert v.word == "inconclusive" and f"fewer than {MIN_REPEATS} runs" in v.headline
    assert "--repeat 3" in v.reason


def test_no_single_instance_no_verdict() -> None:
    assert decide({2: runs(1, 2, 3)}, None).word == "none"
    assert decide({}, runs(1, 2, 3)).word == "none"


def test_the_clusters_baseline_tells_an_instance_wall_from_a_kernel_wall() -> None:
    lwlock = Evidence(waits={"WAL insert": 0.55, "CPU": 0.3, "client": 0.15},
                      cpu={"user": 0.4, "system": 0.2, "idle": 0.4})
    v = decide({4: runs(180, 185, 190)}, runs(95, 100, 105), multi_instance=runs(175, 182, 188), evidence=lwlock)
    assert v.word == "helps"
    assert v.reason.startswith("the single instance waits mostly on WAL insert (55 % of session time): the wall is "
                               "inside the one PostgreSQL instance; 4 clusters in one guest do as well as 4 guests")
    v = decide({4: runs(180, 185, 190)}, runs(95, 100, 105), multi_instance=runs(97, 99, 104), evidence=KERNEL_WALL)
    assert v.reason.endswith("4 clusters in one kernel do not reach 4 guests: carving into 4 removes it")


def test_evidence_clauses() -> None:
    assert "not measured" in evidence_clause(None)
    client = Evidence(waits={"client": 0.8, "CPU": 0.2}, cpu={"user": 0.2, "system": 0.1, "idle": 0.7})
    assert "raise --clients" in evidence_clause(client)
    network = Evidence(waits={"SyncRep": 0.7, "CPU": 0.3}, cpu={"user": 0.3, "system": 0.1, "idle": 0.6})
    assert "round trip to the standby hosts" in evidence_clause(network)


def test_decided_from_summarized_cases() -> None:
    def case(*tps: float, **extra: object) -> dict[str, object]:
        return summarize_runs([{"aggregate_tps": t, **extra} for t in tps])

    single = case(68_000, 70_000, 72_000, waits={"sessions": 40, "shares": dict(KERNEL_WALL.waits)},
                  guest_cpu={"g": dict(KERNEL_WALL.cpu or {})})
    v = decide_from_cases({8: case(185_000, 190_000, 195_000), 2: {"error": "boot failed"}}, single, 1, False)
    assert v.word == "helps" and v.headline == "carving helps, 8 guests, 2.7x" and "shared kernel" in v.reason
    assert v.to_dict()["text"] == v.text


def test_a_gain_of_a_smaller_n_within_the_noise_but_not_beyond_single_is_not_recommended() -> None:
    carved = {2: runs(100, 108, 125), 4: runs(118, 122, 126)}
    v = decide(carved, runs(95, 100, 105))
    assert v.word == "helps" and v.recommended_instances == 4, "2 guests overlap the best but not beyond single"


def test_one_small_guest_beating_one_with_all_the_vcpus_is_not_carving() -> None:
    v = decide({1: runs(190, 195, 200), 2: runs(120, 125, 130)}, runs(95, 100, 105), vcpus=2)
    assert v.word == "does not help" and v.recommended_instances == 1
    assert v.headline == "carving does not help: one guest of 2 vCPU(s) is best, 1.9x over one with all 4"
