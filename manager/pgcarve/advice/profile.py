"""The host kernel's hottest symbols while a case runs, where `perf` is installed on the host.

The experiment found its wall this way: `perf top` on the primary's host showed most of the time
in the kernel, in `__mutex_lock_slowpath` under `epoll_ctl`. Here the profile is taken on the
host that runs the guests (system-wide, kernel space only, the cpu-clock software event, which
works without a hardware PMU, as in most VMs). A guest's own kernel is not visible to the host's
perf: what shows is the host's side of the guests (KVM exits, vhost, the emulator's system calls).
The recording is bounded by the load's own duration.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

EVENT = "cpu-clock:k"
FREQUENCY_HZ = 499
TOP = 12
MIN_SHARE = 0.5  # percent: symbols below it are noise in a few seconds of samples
SEEN_FROM = "the host's kernel (a guest's own kernel is not visible to the host's perf)"
# "    12.34%  [k] __mutex_lock_slowpath" in `perf report --stdio --sort sym`
REPORT_LINE = re.compile(r"^\s*([0-9.]+)%\s+\[(k|\.)\]\s+(\S.*?)\s*$")


def perf_path() -> str | None:
    return shutil.which("perf")


class KernelProfile:
    """`perf record` over the whole host for `seconds`, started before the load; `result()` once
    the load is over."""

    def __init__(self, seconds: int):
        self.seconds = seconds
        self.perf = perf_path()
        self._dir = Path(tempfile.mkdtemp(prefix="pgcarve-perf-"))
        self._data = self._dir / "perf.data"
        self._proc: subprocess.Popen[str] | None = None
        if self.perf is not None:
            self._proc = subprocess.Popen(
                [self.perf, "record", "-a", "-q", "-e", EVENT, "-F", str(FREQUENCY_HZ), "-o", str(self._data),
                 "--", "sleep", str(seconds)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(self) -> dict[str, Any]:
        """{"available", "seen_from", "event", "samples", "symbols": [{"symbol", "share"}]} or why not."""
        try:
            if self.perf is None or self._proc is None:
                return {"available": False, "why": "perf is not installed on the host (Debian: linux-perf)"}
            try:
                _, err = self._proc.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.communicate()
                return {"available": False, "why": "perf record did not end with the load"}
            if self._proc.returncode != 0 or not self._data.exists():
                return {"available": False, "why": f"perf record failed: {(err or '').strip()[-300:]}"}
            report = subprocess.run([self.perf, "report", "-i", str(self._data), "--stdio", "--sort", "sym",
                                     "--no-children", "-g", "none", "--percent-limit", str(MIN_SHARE)],
                                    capture_output=True, text=True, timeout=120, check=False)
            if report.returncode != 0:
                return {"available": False, "why": f"perf report failed: {report.stderr.strip()[-300:]}"}
            return {"available": True, "seen_from": SEEN_FROM, "event": EVENT, "seconds": self.seconds,
                    "samples": samples_of(report.stdout), "symbols": hottest(report.stdout)}
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


def hottest(report: str, top: int = TOP) -> list[dict[str, Any]]:
    """The `top` symbols of a `perf report --stdio --sort sym` text, with their share (percent)."""
    found: list[tuple[float, str]] = []
    for line in report.splitlines():
        match = REPORT_LINE.match(line)
        if match:
            found.append((float(match.group(1)), match.group(3)))
    found.sort(key=lambda f: -f[0])
    return [{"symbol": symbol, "share": share} for share, symbol in found[:top]]


def samples_of(report: str) -> int | None:
    """The sample count perf report states in its header ("# Samples: 12K of event ...")."""
    match = re.search(r"^# Samples: ([0-9.]+)([KM]?)", report, flags=re.M)
    if not match:
        return None
    return int(float(match.group(1)) * {"": 1, "K": 1000, "M": 1000000}[match.group(2)])
