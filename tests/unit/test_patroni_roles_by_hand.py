"""A switchover asked of Patroni whose answer timed out ("status unknown") is not a failure: the
manager reads the new leader from etcd, as after a clear answer, and fails only if none leads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pgcarve.control import patroni_roles_by_hand as by_hand
from pgcarve.control.fleet import Fleet, Guest, Instance
from pgcarve.errors import GuestNotReady, PatroniOutcomeUnknown


def _guest(name: str, host: str) -> Guest:
    info = cast(Any, SimpleNamespace(name=name, host=host))
    return Guest(info=info, address="10.77.0.2", endpoint=("127.0.0.1", 1))


class TimedOut:
    """Patroni's REST API taking the request, then giving up waiting for its result."""

    def __enter__(self) -> TimedOut:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def switchover(self, leader: str, candidate: str | None = None) -> str:
        raise PatroniOutcomeUnknown("Patroni on pgc-01 does not know whether the switchover happened "
                                    "(Switchover status unknown): read the cluster's state before asking again")


def _world(monkeypatch: pytest.MonkeyPatch, leaders: Iterator[str]) -> tuple[Fleet, Instance]:
    old, new = _guest("pgc-01", "h0"), _guest("pgc-01-s1", "h1")
    patroni = SimpleNamespace(leader=lambda _name, fresh=False: next(leaders))
    fleet = cast(Fleet, SimpleNamespace(patroni=patroni, connect=lambda _g, timeout_s=3: contextlib.nullcontext()))
    monkeypatch.setattr(by_hand, "patroni_api", lambda _fleet, _guest: TimedOut())
    monkeypatch.setattr(by_hand.replication, "in_recovery", lambda _conn: False)
    monkeypatch.setattr(by_hand, "NEW_LEADER_TIMEOUT_S", 1)
    return fleet, Instance(1, "pgc-01", old, (new,))


def test_a_switchover_whose_answer_timed_out_reads_the_new_leader_from_etcd(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, inst = _world(monkeypatch, iter(["pgc-01", "pgc-01-s1", "pgc-01-s1"]))
    done = by_hand.switchover(fleet, inst, None, lambda *_a: None)
    assert done.result["new_primary"] == "pgc-01-s1" and done.result["host"] == "h1"
    assert "no answer in time; the new leader was read from etcd" in done.message


def test_a_switchover_that_did_not_happen_says_who_still_leads(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, inst = _world(monkeypatch, iter(lambda: "pgc-01", None))
    with pytest.raises(GuestNotReady, match=r"no new leader accepted writes within 1 s .* Patroni's leader is pgc-01"):
        by_hand.switchover(fleet, inst, None, lambda *_a: None)
