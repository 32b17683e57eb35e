"""`make test` in two lanes on two cores, and a table of where the time went.

The guest lane builds (or finds) the guest image, then runs the tests that boot guests, in one
pytest process so that they share their fleets. The local lane, at a lower CPU priority so that
booting guests go first, runs lint and the unit tests (a failure there is printed within minutes,
not after the fleets), builds (or finds) the Terraform tools, then runs every other test that
needs no guest: the Terraform module's, local PostgreSQL servers, the dashboard in Chromium,
Prometheus. Neither lane waits for the other (the Terraform integration test, last in the guest
lane, waits for the tools if they are still being built); the run fails if any step failed.

The guest lane's output is streamed as it comes; each local step's output goes to a log file
under tests/output/ and is printed in full when the step fails. At the end: one row per step
and per guest module with its wall time and the machine's CPU use (from /proc/stat), then a
closing line with the counts of every pytest run.

Standard library only: it runs with the system's python3 (`python3 -m tests.lanes` from the
repository) before the venv exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.cpu import cpu_counters, cpu_share

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "tests" / "output"
PY = str(REPO / ".venv" / "bin" / "python")
LOCAL_NICENESS = 10


@dataclass
class Step:
    name: str
    argv: list[str]
    lane: str
    junit: Path | None = None  # pytest's report, for the counts
    started: float = 0.0
    ended: float = 0.0
    cpu_before: list[int] = field(default_factory=list)
    cpu_after: list[int] = field(default_factory=list)
    returncode: int | None = None
    log: Path | None = None

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def module_times(self) -> Path:
        """Where its pytest run records each module's start and end (tests/support/timing.py)."""
        return OUTPUT / f"{self.name.replace(' ', '-')}.modules.jsonl"


def pytest_step(name: str, lane: str, args: list[str]) -> Step:
    slug = name.replace(" ", "-")
    junit = OUTPUT / f"{slug}.xml"
    return Step(name, [PY, "-m", "pytest", *args, f"--junitxml={junit}"], lane, junit=junit)


def guest_lane() -> list[Step]:
    return [
        Step("image", ["make", "--no-print-directory", "image"], "guests"),
        # What the tests print or log (detection and recovery times, commits kept, Terraform's
        # commands) is kept in the guest lane's report under tests/output/, not repeated here.
        pytest_step("guest tests", "guests", ["tests/integration", "-m", "integration", "-v", "--durations=10",
                                              "-o", "junit_logging=all",
                                              *(f"--ignore={test}" for test in NOT_IN_GUEST_LANE)]),
    ]


# Not in `make test`, which must fit CI's machine (2 cores, guests under emulation): every guest
# boot costs minutes of a core there, and a second sandbox's boots beside the shared fleet's made
# both crawl (a standby of the fleet's took 830 s to answer SQL beside the advisor's guests).
# `make test-extended` runs these, each on a sandbox of its own: the advisor (ten guests in four
# case fleets) and the sandbox over ssh, as production runs it. Patroni's (`make test-patroni`)
# is not part of the run yet: see the Makefile.
EXTENDED_TESTS = ("tests/integration/test_advise.py", "tests/integration/test_remote_hosts.py")
PATRONI_TESTS = ("tests/integration/test_patroni.py", "tests/integration/test_patroni_faults.py")
NOT_IN_GUEST_LANE = (*EXTENDED_TESTS, *PATRONI_TESTS)


# The unit tests of the Terraform module run its terraform and tflint: after the tools' build,
# which takes minutes on a machine that never built them, so the other unit tests go first.
NEEDS_TOOLS = "tests/unit/test_tfvars.py"


def local_lane() -> list[Step]:
    return [
        Step("lint", ["make", "--no-print-directory", "lint"], "local"),
        pytest_step("unit tests", "local", ["tests/unit", "-q", f"--ignore={NEEDS_TOOLS}"]),
        Step("tools", ["make", "--no-print-directory", "tools"], "local"),
        pytest_step("local tests", "local",
                    [NEEDS_TOOLS, "tests/integration", "tests/browser", "tests/monitoring", "-m", "not integration",
                     "-q", "--durations=10"]),
    ]


class Run:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.print_lock = threading.Lock()

    def say(self, lane: str, text: str) -> None:
        elapsed = int(time.monotonic() - self.t0)
        with self.print_lock:
            print(f"[{elapsed // 60:3d}:{elapsed % 60:02d} {lane}] {text}", flush=True)

    def run_step(self, step: Step, stream: bool, niceness: int) -> None:
        step.module_times.unlink(missing_ok=True)
        env = dict(os.environ, PGCARVE_TEST_TIMES=str(step.module_times), PYTHONUNBUFFERED="1")
        step.cpu_before, step.started = cpu_counters(), time.monotonic()
        self.say(step.lane, f"{step.name}: started")
        step.log = OUTPUT / f"{step.name.replace(' ', '-')}.log"
        with step.log.open("w") as log:
            proc = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace",
                                    preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if stream:
                    self.say(step.lane, line.rstrip("\n"))
            step.returncode = proc.wait()
        step.cpu_after, step.ended = cpu_counters(), time.monotonic()
        verdict = "ok" if step.returncode == 0 else f"FAILED (exit {step.returncode})"
        self.say(step.lane, f"{step.name}: {verdict} in {step.seconds:.0f} s; {summary_line(step)}")
        if step.returncode != 0 and not stream:
            with self.print_lock:
                print(f"----- output of {step.name} ({step.log}) -----")
                print(step.log.read_text(errors="replace"), flush=True)
                print(f"----- end of {step.name} -----", flush=True)

    def run_lane(self, steps: list[Step], stream: bool, niceness: int) -> None:
        for step in steps:
            self.run_step(step, stream, niceness)
            if step.returncode != 0 and step.name in ("image", "tools"):
                # A failed build leaves nothing to test: the lane's tests are reported as not run.
                self.say(step.lane, f"{step.name} failed: the rest of this lane is not run")
                return


def summary_line(step: Step) -> str:
    counts = junit_counts(step)
    if counts is None:
        return ""
    passed, failed, skipped = counts
    return f"{passed} passed, {failed} failed, {skipped} skipped"


def junit_counts(step: Step) -> tuple[int, int, int] | None:
    if step.junit is None or not step.junit.exists():
        return None
    suite = ET.parse(step.junit).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    tests, failures, errors, skipped = (int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped"))
    return tests - failures - errors - skipped, failures + errors, skipped


def module_rows(times_file: Path) -> list[tuple[str, float, list[int], list[int]]]:
    """(module, seconds, cpu at start, cpu at end) for every module the runs timed."""
    if not times_file.exists():
        return []
    starts: dict[str, tuple[float, list[int]]] = {}
    rows = []
    for line in times_file.read_text().splitlines():
        event = json.loads(line)
        module, at, cpu = str(event["module"]), float(event["at"]), [int(v) for v in event["cpu"]]
        if event["event"] == "start":
            starts[module] = (at, cpu)
        elif module in starts:
            began, cpu_began = starts.pop(module)
            rows.append((module, at - began, cpu_began, cpu))
    return rows


def report(steps: list[Step], run: Run, cpu_start: list[int], setup_s: float) -> int:
    cpu_end = cpu_counters()
    wall = time.monotonic() - run.t0
    print("\n===== where the time went =====")
    print(f"{'step':<44} {'lane':<7} {'wall':>7}  machine CPU over the step")
    if setup_s:
        print(f"{'set-up (make deps: apt, venv, vendor)':<44} {'-':<7} {setup_s:6.0f}s")
    for step in steps:
        if step.returncode is None:
            print(f"{step.name:<44} {step.lane:<7} {'not run':>7}")
            continue
        print(f"{step.name:<44} {step.lane:<7} {step.seconds:6.0f}s  {cpu_share(step.cpu_before, step.cpu_after)}")
        rows = module_rows(step.module_times)
        if step.lane == "guests":  # each module that boots guests on its own row
            for module, seconds, before, after in rows:
                print(f"  {module.removeprefix('tests/'):<42} {'':<7} {seconds:6.0f}s  {cpu_share(before, after)}")
        else:  # the rest by directory
            by_directory: dict[str, float] = {}
            for module, seconds, _before, _after in rows:
                directory = module.split("/")[1]
                by_directory[directory] = by_directory.get(directory, 0.0) + seconds
            for directory, seconds in by_directory.items():
                print(f"  {'tests/' + directory:<42} {'':<7} {seconds:6.0f}s")
    print(f"{'whole run (lanes side by side)':<44} {'':<7} {wall + setup_s:6.0f}s  {cpu_share(cpu_start, cpu_end)}")
    totals = [0, 0, 0]
    for step in steps:
        counts = junit_counts(step)
        if counts:
            totals = [t + c for t, c in zip(totals, counts, strict=True)]
    failed_steps = [s.name for s in steps if s.returncode != 0]
    if failed_steps:
        print(f"failed or not run: {', '.join(failed_steps)}")
    # The plain closing line CI reads, over every pytest run of both lanes.
    print(f"tests: {totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    return 1 if failed_steps else 0


def main() -> int:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    run = Run()
    setup_s = float(os.environ.get("PGCARVE_SETUP_S", "0"))
    cpu_start = cpu_counters()
    guests, local = guest_lane(), local_lane()
    lanes = [threading.Thread(target=run.run_lane, args=(guests, True, 0), name="guests"),
             threading.Thread(target=run.run_lane, args=(local, False, LOCAL_NICENESS), name="local")]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    return report([*guests, *local], run, cpu_start, setup_s)


if __name__ == "__main__":
    sys.exit(main())
