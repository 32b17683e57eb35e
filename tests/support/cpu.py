"""The machine's CPU counters from /proc/stat, and what share of them was busy between two
readings: for the table `make test` prints (tests/lanes.py and its per-module clock,
tests/support/timing.py). Standard library only: the lanes run before the venv exists."""

from __future__ import annotations


def cpu_counters() -> list[int]:
    """Aggregate CPU times (user nice system idle iowait irq softirq steal), in clock ticks."""
    with open("/proc/stat") as stat:
        return [int(v) for v in stat.readline().split()[1:9]]


def cpu_share(before: list[int], after: list[int]) -> str:
    """The machine's CPU use between two readings: busy share, and user/system/steal."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(delta) or 1
    user, nice, system, idle, iowait, irq, softirq, steal = delta
    busy = total - idle - iowait
    return (f"{busy * 100 / total:3.0f}% busy (user {(user + nice) * 100 / total:.0f}, "
            f"system {(system + irq + softirq) * 100 / total:.0f}, steal {steal * 100 / total:.0f})")
