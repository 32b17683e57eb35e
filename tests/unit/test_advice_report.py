"""The advice report (pgcarve.advice.report) from a recorded document: the terminal summary and
the HTML page name the verdict, the versions measured and every case, and the page fetches
nothing."""

from __future__ import annotations

from typing import Any

from pgcarve.advice.cases import summarize_runs
from pgcarve.advice.profile import hottest, samples_of
from pgcarve.advice.report import render_html, render_text
from pgcarve.advice.verdict import Runs, decide


def case(*tps: float, syncrep: float = 0.6, vcpus: int = 1, guests: int = 1) -> dict[str, Any]:
    runs = [{"aggregate_tps": t, "latency_p50_ms": 0.9, "latency_p99_ms": 3.1,
             "guests": {f"g{k}": {"vcpus": vcpus} for k in range(guests)},
             "guest_cpu": {"g0": {"user": 0.1, "system": 0.3, "idle": 0.6}},
             "host_cpu": {"user": 0.2, "system": 0.2, "idle": 0.6},
             "waits": {"sessions": 100, "shares": {"SyncRep": syncrep, "CPU": 1 - syncrep}}} for t in tps]
    return summarize_runs(runs)


def recorded() -> dict[str, Any]:
    verdict = decide({1: Runs((9_900, 10_000, 10_100)), 8: Runs((186_000, 190_000, 193_000))},
                     Runs((68_500, 70_000, 71_200)), vcpus=8)
    return {
        "plan": {"host": "db1", "standby_hosts": ["db2", "db3"], "vcpus_per_guest": 8, "repeat": 3, "seconds": 120,
                 "cases": [{"cases": ["carved-1"]}, {"cases": ["carved-8"]}, {"cases": ["single"]},
                           {"cases": ["multi-instance"]}]},
        "domain_types": {"db1": "kvm", "db2": "kvm", "db3": "kvm"},
        "versions": {"host": {"kernel": "6.12.9-amd64", "qemu": "QEMU emulator version 9.2.1"},
                     "guest": {"kernel": "Linux version 6.1.0-56-cloud-amd64 (debian-kernel@lists.debian.org)",
                               "postgresql": "PostgreSQL 15.20"},
                     "image": {"kernel": "6.1.0-56-cloud-amd64", "postgresql": "15.20-0+deb12u1"}},
        "load": {"script": "insert into test(info) values (null);", "clients": 64, "seconds": 120},
        "cases": {"carved-1": case(9_900, 10_000, 10_100, guests=1), "carved-8": case(186_000, 190_000, 193_000,
                                                                                      guests=8),
                  "single": case(68_500, 70_000, 71_200, vcpus=64),
                  "multi-instance": {"case": "multi-instance", "error": "cluster 3 not ready"}},
        "verdict": verdict.to_dict(), "host_left_as_it_was": True, "left_behind": [],
        "kept": ["db1: volume pgcarve-base-abc added"],
    }


def test_the_terminal_summary() -> None:
    text = render_text(recorded())
    assert "verdict: carving helps, 8 guests, 2.7x" in text
    assert ("versions: guest kernel 6.1.0-56-cloud-amd64; guest PostgreSQL 15.20; host kernel 6.12.9-amd64; "
            "QEMU 9.2.1") in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("carved-", "single", "multi-"))}
    assert "190,000" in rows["carved-8"] and "186,000, 190,000, 193,000" in rows["carved-8"]
    assert rows["carved-8"].split()[1] == "8" and rows["single"].split()[2] == "64"
    assert "SyncRep 60%" in rows["single"] and "10/30/60" in rows["single"]
    assert rows["multi-instance"].endswith("failed: cluster 3 not ready")
    assert "host left as it was: yes (kept for the next run: 1 volume(s) of the guest image on db1)" in text


def test_the_html_page_is_self_contained() -> None:
    page = render_html(recorded())
    assert '<p class="verdict" id="verdict">carving helps, 8 guests, 2.7x</p>' in page
    assert page.count("<svg") == 2 and page.count("<circle") == 9, "a dot per run of the three cases that ran"
    assert "guest kernel 6.1.0-56-cloud-amd64" in page and "failed: cluster 3 not ready" in page
    assert "src=" not in page and "href=" not in page and "@import" not in page


def test_emulation_is_said_plainly() -> None:
    doc = recorded()
    doc["verdict"] = decide({2: Runs((185.0, 190.0, 195.0))}, Runs((68.0, 70.0, 72.0)), emulated=True).to_dict()
    assert "caveat: the guests ran under QEMU TCG" in render_text(doc)
    assert "class='caveat'>the guests ran under QEMU TCG" in render_html(doc)


PERF_REPORT = """# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 12K of event 'cpu-clock:k'
# Event count (approx.): 3012000000
#
# Overhead  Symbol
# ........  ..............................
#
    41.20%  [k] __mutex_lock_slowpath
    17.03%  [k] mutex_spin_on_owner
     6.50%  [k] _raw_spin_lock
     0.80%  [.] not_a_kernel_symbol_but_listed
"""


def test_the_single_instances_kernel_profile_is_reported() -> None:
    """perf's report parsed into the hottest symbols, which both reports name; a host without perf
    is said so, not left blank."""
    symbols = hottest(PERF_REPORT)
    assert symbols[:2] == [{"symbol": "__mutex_lock_slowpath", "share": 41.2},
                           {"symbol": "mutex_spin_on_owner", "share": 17.03}]
    assert samples_of(PERF_REPORT) == 12_000
    doc = recorded()
    doc["cases"]["single"]["kernel_profile"] = {"available": True, "seen_from": "the host's kernel",
                                                "event": "cpu-clock:k", "samples": 12_000, "symbols": symbols}
    assert ("during the single instance, seen from the host's kernel (perf cpu-clock:k, 12000 samples): "
            "__mutex_lock_slowpath 41.2 %, mutex_spin_on_owner 17.0 %") in render_text(doc)
    assert "id='profile'" in render_html(doc) and "__mutex_lock_slowpath 41.2 %" in render_html(doc)
    doc["cases"]["single"]["kernel_profile"] = {"available": False, "why": "perf is not installed on the host"}
    assert "host kernel profile: not taken (perf is not installed on the host)" in render_text(doc)
