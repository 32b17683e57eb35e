"""What `pgcarve doctor` reports: findings, and the one line that sums them up.

"fail" is only for what would make a scale fail; "warn" for what works but costs (emulation), or
what cannot be checked over libvirt, said as such (NOT_CHECKED); "ok" for what was checked, with
the facts found. The checks are control/doctor.py (hosts) and control/doctor_network.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]
FLEET = "(fleet)"  # the host of findings about the fleet as a whole
NOT_CHECKED = "not checked over libvirt"


@dataclass(frozen=True)
class Finding:
    """One check on one host (or on the fleet: host FLEET)."""

    host: str
    check: str
    status: Status
    message: str  # what is wrong or found, the limit, what to do

    @property
    def headline(self) -> str:
        """What is wrong, without what to do: the message up to its first ': '."""
        return self.message.split(": ", 1)[0]

    def to_dict(self) -> dict[str, str]:
        return {"host": self.host, "check": self.check, "status": self.status, "message": self.message}


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def summary(findings: list[Finding], hosts: int) -> str:
    """One line: how many hosts, and the problems that would make a scale fail, by host."""
    fails = [f for f in findings if f.status == "fail"]
    warnings = sum(1 for f in findings if f.status == "warn")
    checked = f"{plural(hosts, 'host')} checked"
    noted = f"; {plural(warnings, 'warning')}" if warnings else ""
    if not fails:
        return f"{checked}: nothing that would make a scale fail{noted}"
    named = "; ".join(f"{f.host}: {f.headline}" for f in fails)
    what = "problem that would" if len(fails) == 1 else "problems that would"
    return f"{checked}: {len(fails)} {what} make a scale fail ({named}){noted}"
