"""Small measurements every case shares: nearest-rank percentiles and the /proc/stat CPU split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pgcarve.errors import PgcarveError

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (pct in 0..100); NaN-free: 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-pct * len(ordered) // 100))))
    return float(ordered[rank - 1])


def parse_proc_stat(text: str) -> dict[str, int]:
    """The aggregate ``cpu`` line of /proc/stat, in jiffies."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:]]
            return {name: values[i] if i < len(values) else 0 for i, name in enumerate(CPU_FIELDS)}
    raise PgcarveError("no aggregate cpu line in /proc/stat")


def cpu_split(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, float]:
    """User/system/idle/steal shares (0..1) between two /proc/stat samples.

    user includes nice (and the guest time the kernel also counts in user); system includes irq
    and softirq; idle includes iowait.
    """
    d = {k: after.get(k, 0) - before.get(k, 0) for k in CPU_FIELDS}
    user = d["user"] + d["nice"]
    system = d["system"] + d["irq"] + d["softirq"]
    idle = d["idle"] + d["iowait"]
    total = user + system + idle + d["steal"]
    if total <= 0:
        return {"user": 0.0, "system": 0.0, "idle": 0.0, "steal": 0.0, "guest": 0.0, "jiffies": 0.0}
    return {
        "user": round(user / total, 4),
        "system": round(system / total, 4),
        "idle": round(idle / total, 4),
        "steal": round(d["steal"] / total, 4),
        "guest": round((d["guest"] + d["guest_nice"]) / total, 4),
        "jiffies": float(total),
    }


def host_proc_stat() -> dict[str, int]:
    """This machine's aggregate CPU counters."""
    return parse_proc_stat(Path("/proc/stat").read_text())


def mean_cpu(splits: Sequence[Mapping[str, float] | None]) -> dict[str, float] | None:
    """The mean user/system/idle of the guests that reported a split."""
    known = [c for c in splits if c]
    if not known:
        return None
    return {k: round(sum(c[k] for c in known) / len(known), 4) for k in ("user", "system", "idle")}
