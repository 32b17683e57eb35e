"""`pgcarve advise`'s rounds (advice/rounds.py): a group whose guests do not come up is tried once
more on new guests; a second failure is recorded against each of its cases, and the other groups'
results stay."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pgcarve.advice import rounds
from pgcarve.advice.cases import CASE_DOC, LoadParams
from pgcarve.advice.rounds import CaseGroup, RoundsResult, run_rounds
from pgcarve.config import FleetConfig, HostConfig, Replication
from pgcarve.errors import GuestStuck
from pgcarve.settings import Paths

CASE = next(iter(CASE_DOC))


def group(kind: str) -> CaseGroup:
    config = FleetConfig(fleet="pgc", replication=Replication(standbys=0),
                         hosts=[HostConfig(name="h0", uri="test:///default")])
    return CaseGroup(kind=kind, config=config, instances=1, n=1, cases=((f"{kind}-case", CASE),))


@dataclass
class Boots:
    """Each case fleet made (by name); a group whose kind is in `failing` fails to come up that
    many times."""

    made: list[str] = field(default_factory=list)
    failing: dict[str, int] = field(default_factory=dict)


@pytest.fixture
def boots(monkeypatch: pytest.MonkeyPatch) -> Boots:
    seen = Boots()

    @contextlib.contextmanager
    def instances_up(config: FleetConfig, paths: Paths, count: int, record: dict[str, Any], progress: Any,
                     boot_timeout_s: float) -> Iterator[Any]:
        seen.made.append(config.fleet)
        kind = config.fleet[len("adv"):][:1]
        if seen.failing.get(kind, 0) > 0:
            seen.failing[kind] -= 1
            raise GuestStuck(f"{config.fleet}-01 on h0: boot stopped at stage 'address'", "address")
        yield SimpleNamespace(observe=lambda: [SimpleNamespace(primary="its primary")])

    monkeypatch.setattr(rounds, "instances_up", instances_up)
    monkeypatch.setattr(rounds, "run_case", lambda case, fleet, n, load, settings, logdir, say: {"tps": 1.0})
    monkeypatch.setattr(rounds, "guest_facts", lambda fleet, guest: {"postgresql": "17"})
    return seen


def run(groups: list[CaseGroup], tmp_path: Path) -> tuple[RoundsResult, list[str]]:
    said: list[str] = []
    found = run_rounds(groups, Paths(tmp_path), 1, LoadParams(clients=1, threads=1, seconds=1), tmp_path, "adv",
                       say=said.append)
    return found, said


def test_a_group_that_did_not_come_up_is_tried_once_more_on_new_guests(boots: Boots, tmp_path: Path) -> None:
    boots.failing = {"a": 1}
    found, said = run([group("a"), group("b")], tmp_path)
    assert found.runs["a-case"] == [{"tps": 1.0, "boot_s": None, "fleet": boots.made[1], "round": 1, "n": 1,
                                     "measured_at": found.runs["a-case"][0]["measured_at"]}]
    assert len(boots.made) == 3 and boots.made[0] != boots.made[1], "the second try is on a fleet of a new name"
    assert any("a-case failed: " in line and "trying it once more, on new guests" in line for line in said)
    assert "error" not in found.runs["b-case"][0]


def test_a_group_failing_twice_is_recorded_as_failed_and_the_others_still_run(boots: Boots, tmp_path: Path) -> None:
    boots.failing = {"a": 2}
    found, said = run([group("a"), group("b")], tmp_path)
    (failed,) = found.runs["a-case"]
    assert "boot stopped at stage 'address'" in failed["error"] and failed["case"] == CASE
    assert found.recorded() == 2 and "error" not in found.runs["b-case"][0]
    assert any(line.startswith("a-case failed again: ") for line in said)
