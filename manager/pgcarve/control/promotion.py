"""Which standby may be promoted without losing an acknowledged commit (a pure decision).

The rule (Patroni's synchronous_mode_strict, CloudNativePG's failover quorum): with R the
recorded synchronous set (control/sync_record.py) and k the standbys each commit waits for, every
acknowledged commit is on at least k members of R. If at least |R| - k + 1 members of R answer,
one of them has every acknowledged commit, and so has any standby that received at least as much
WAL as each of them: the answering standby with the most WAL is safe to promote. With fewer
answering, nothing is promoted automatically; a forced promotion names what may be missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pgcarve.control.sync_record import SyncRecord


@dataclass(frozen=True)
class StandbyAnswer:
    """What one standby said when asked (or that it did not answer)."""

    name: str
    host: str
    answered: bool
    in_recovery: bool = True
    received_lsn: int = -1  # the furthest WAL received or replayed; -1 unknown


@dataclass(frozen=True)
class Promotion:
    """The decision: `candidate` to promote, or None, and why, in an operator's words."""

    candidate: str | None
    reason: str
    proven: bool  # True: the candidate provably holds every acknowledged commit
    may_be_missing: str = ""  # for a forced promotion: what may not be on the candidate


def _names(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "none"


def decide(record: SyncRecord, answers: Sequence[StandbyAnswer]) -> Promotion:
    """The standby to promote automatically, only if it provably holds every acknowledged commit."""
    already = [a for a in answers if a.answered and not a.in_recovery]
    if already:
        # A failover promoted it before the manager stopped: finish that one, never promote a second.
        return Promotion(already[0].name, f"{already[0].name} was already promoted; finishing that failover", True)
    standbys = [a for a in answers if a.answered and a.in_recovery]
    members = [a for a in standbys if a.name in record.members]
    silent = [m for m in record.members if m not in {a.name for a in members}]
    if not record.members:
        return Promotion(None, f"{record.instance}: no standby was ever recorded as synchronous, so none can be "
                               "proven to hold the acknowledged commits", False)
    if len(members) < record.quorum:
        return Promotion(
            None,
            f"{record.instance}: {len(members)} of the {len(record.members)} standbys that may hold acknowledged "
            f"commits ({_names(record.members)}) answered; {record.quorum} must answer to prove a standby has them "
            f"all (not answering: {_names(silent)}). Nothing was promoted. Bring one of them back, or promote by "
            f"hand: POST /v1/instances/{record.instance}/failover {{\"to\": \"<standby>\", \"force\": true}}",
            False,
        )
    best = max(standbys, key=lambda a: (a.received_lsn, a.name in record.members, -len(a.name), a.name))
    return Promotion(best.name, f"{best.name} on {best.host} has the most WAL of the standbys that answered "
                                f"({len(members)} of {len(record.members)} in the synchronous set answered; "
                                f"{record.quorum} needed)", True)


def force(record: SyncRecord, answers: Sequence[StandbyAnswer], to: str) -> Promotion:
    """A promotion an operator asked for: `to` if it answers, with what may be missing on it."""
    target = next((a for a in answers if a.name == to), None)
    if target is None or not target.answered:
        return Promotion(None, f"{to} does not answer; it cannot be promoted", False)
    proven = decide(record, answers)
    if proven.proven and proven.candidate == to:
        return Promotion(to, f"{to} provably holds every acknowledged commit ({proven.reason})", True)
    ahead = [a.name for a in answers if a.answered and a.received_lsn > target.received_lsn and a.name != to]
    silent = [m for m in record.members if m != to and not any(a.name == m and a.answered for a in answers)]
    missing = []
    if silent:
        missing.append(f"commits acknowledged by {_names(silent)} (not answering) after {to} last received WAL")
    if ahead:
        missing.append(f"WAL that {_names(ahead)} received beyond {to}")
    text = "; ".join(missing) or "nothing known: every member of the synchronous set answered"
    return Promotion(to, f"forced promotion of {to} as asked", False, may_be_missing=text)
