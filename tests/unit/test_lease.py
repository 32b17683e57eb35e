"""The managers' leadership lease (control/leadership.py) against a real etcd on loopback
(tests/support/local_etcd.py): one leader at a time, an epoch that grows on every takeover, a
standby that takes over when the leader's lease lapses, a fence that refuses a paused leader's
steps, and a clean stop that hands over at once. Short leases (4 s) keep it quick; the figures
in production are LEASE_TTL_S and the intervals beside it."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pgcarve.config import EtcdConfig
from pgcarve.control.leadership import (
    TAKEOVER_BOUND_S,
    LeaderInfo,
    Leadership,
    describe_role,
    epoch_key,
    leader_key,
)
from pgcarve.control.operations import Operation, OperationQueue
from pgcarve.dcs.etcd import EtcdClient, EtcdKv
from pgcarve.errors import NotLeader
from pgcarve.processes import record_self

from tests.support.local_etcd import etcd_binary, local_etcd

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (make deps installs it)")

TTL_S = 4  # short, yet a renewal every 0.5 s keeps it on a loaded machine


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdConfig]:
    with local_etcd(tmp_path_factory.mktemp("etcd")) as config:
        yield config


class Clock:
    """A monotonic clock a test can move forward: a paused process sees time jump."""

    def __init__(self) -> None:
        self.skew = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skew


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


_fleets = iter(range(1000))


def fleet_name() -> str:
    return f"t{next(_fleets)}"  # a fleet of its own per test: one etcd serves the module


def manager(etcd: EtcdConfig, fleet: str, url: str, clock: Callable[[], float] = time.monotonic,
            elected: list[int] | None = None, lost: list[str] | None = None) -> Leadership:
    """A campaign with short intervals; its takeover is done at once (the service's is control/terms.py)."""
    lead = Leadership(etcd, fleet, url=url, ttl_s=TTL_S, renew_s=0.5, poll_s=0.2, clock=clock,
                      on_lost=(lambda _e, reason: lost.append(reason)) if lost is not None else None)

    def on_elected(epoch: int) -> None:
        if elected is not None:
            elected.append(epoch)
        lead.mark_ready(epoch)

    lead.on_elected = on_elected
    return lead


def read_key(etcd: EtcdConfig, key: str) -> str | None:
    with EtcdClient(etcd) as client:
        found = EtcdKv(client).get(key)
    return found.value if found is not None else None


def test_one_leader_the_other_waits_naming_it(etcd: EtcdConfig) -> None:
    fleet = fleet_name()
    a_elected: list[int] = []
    a, b = manager(etcd, fleet, "http://a:1", elected=a_elected), manager(etcd, fleet, "http://b:2")
    a.start()
    wait_for(a.holds_lease, 10, "a first manager leading")
    b.start()
    try:
        wait_for(lambda: b.role().leader is not None, 10, "the second reading the leader")
        assert a_elected == [1] and a.role().role == "leader" and a.role().epoch == 1
        assert b.role().role == "standby" and not b.holds()
        seen = b.role().leader
        assert seen is not None and (seen.id, seen.pid, seen.url, seen.epoch) == (a.id, a.pid, "http://a:1", 1)
        stored = LeaderInfo.parse(read_key(etcd, leader_key(fleet)) or "")
        assert stored is not None and stored.url == "http://a:1" and stored.epoch == 1
        assert a.check("defining pgc-01") == 1
        with pytest.raises(NotLeader, match=r"defining pgc-01: refused.*the leader is the manager at http://a:1"):
            b.check("defining pgc-01")
        assert b.refused == 1 and describe_role(b)["leader"]["url"] == "http://a:1"
        time.sleep(TTL_S + 1)  # several renewals: the lease is kept, no takeover
        assert a.holds_lease() and not b.holds_lease() and a.role().epoch == 1
    finally:
        b.stop()
        a.stop()


def test_a_lost_leader_is_replaced_within_the_bound_at_a_higher_epoch(etcd: EtcdConfig) -> None:
    """The leader stops renewing (its process lost: here its loop is stopped without handing
    over); the standby takes over within TTL + the sweep + a poll, at epoch 2."""
    fleet = fleet_name()
    a = manager(etcd, fleet, "http://a:1")
    b_elected: list[int] = []
    b = manager(etcd, fleet, "http://b:2", elected=b_elected)
    a.start()
    wait_for(a.holds_lease, 10, "a leading")
    b.start()
    try:
        wait_for(lambda: b.role().leader is not None, 10, "b reading the leader")
        a._stop.set()  # no more renewals, no hand-over: as if killed
        a._thread.join(5)
        lost_at = time.monotonic()
        took = wait_for(b.holds_lease, TAKEOVER_BOUND_S + 5, "b taking over")
        bound = TTL_S + 0.5 + 0.2 + 1.5  # the test's TTL and poll; TAKEOVER_BOUND_S with the real ones
        print(f"takeover {time.monotonic() - lost_at:.1f} s after the leader stopped renewing (TTL {TTL_S} s)")
        assert took <= bound, f"took {took:.1f} s, over {bound} s"
        assert b_elected == [2] and b.role().epoch == 2
        stored = LeaderInfo.parse(read_key(etcd, leader_key(fleet)) or "")
        assert stored is not None and stored.epoch == 2 and stored.url == "http://b:2"
    finally:
        b.stop()
        a._kv.client.close()


def test_a_paused_leader_acts_on_nothing_and_steps_down(etcd: EtcdConfig) -> None:
    """A leader whose clock jumps past its lease (as after SIGSTOP/SIGCONT) refuses every step at
    once, before its loop notices; work bound to its old epoch stays refused even if it leads
    again; the loop then steps down and a standby (here: none) or itself campaigns afresh."""
    fleet = fleet_name()
    clock = Clock()
    lost: list[str] = []
    elected: list[int] = []
    a = manager(etcd, fleet, "http://a:1", clock=clock, elected=elected, lost=lost)
    a.start()
    try:
        wait_for(a.holds_lease, 10, "a leading")
        started = threading.Event()
        release = threading.Event()
        refusals: list[str] = []

        def work() -> None:  # an operation that began at epoch 1 and goes on after the pause
            with a.acting():
                started.set()
                release.wait(30)
                try:
                    a.check("starting pgc-02")
                except NotLeader as exc:
                    refusals.append(str(exc))

        worker = threading.Thread(target=work)
        worker.start()
        started.wait(5)
        clock.skew = TTL_S + 5  # "paused" past the lease
        with pytest.raises(NotLeader, match="does not hold"):
            a.check("undefining pgc-01")
        wait_for(lambda: bool(lost), 10, "the loop stepping down")
        wait_for(lambda: a.holds_lease(), 15, "a campaigning again (nobody else)")
        assert elected == [1, 2] and a.role().epoch == 2
        release.set()
        worker.join(5)
        assert refusals and "began this work at epoch 1 and leads at epoch 2" in refusals[0]
    finally:
        release.set()
        a.stop()


def test_a_clean_stop_hands_over_at_once(etcd: EtcdConfig) -> None:
    fleet = fleet_name()
    a, b = manager(etcd, fleet, "http://a:1"), manager(etcd, fleet, "http://b:2")
    a.start()
    wait_for(a.holds_lease, 10, "a leading")
    b.start()
    try:
        wait_for(lambda: b.role().leader is not None, 10, "b reading the leader")
        a.stop()
        took = wait_for(b.holds_lease, 5, "b taking over")
        assert took < TTL_S, f"a clean stop should not wait for the lease ({took:.1f} s)"
        assert b.role().epoch == 2
    finally:
        b.stop()
    assert read_key(etcd, leader_key(fleet)) is None  # b handed over too: nothing left


def test_only_the_leader_runs_operations_and_writes_the_journal(etcd: EtcdConfig, tmp_path: Path) -> None:
    """A standby's queue runs nothing and never writes the journal; on takeover, resume() finds
    what the journal holds unfinished and runs it."""
    fleet = fleet_name()
    journal = tmp_path / "operations.json"
    leader = manager(etcd, fleet, "http://a:1")
    leader.start()
    wait_for(leader.holds_lease, 10, "a leading")
    standby = manager(etcd, fleet, "http://b:2")
    ran: list[str] = []

    def run(op: Operation) -> str:
        ran.append(op.id)
        return "done"

    queue = OperationQueue(run, journal=journal, guard=standby)
    standby.start()
    queue.start(resume=False)
    try:
        first = OperationQueue(lambda op: "done", journal=journal)  # the leader's, stopped at once
        op = first.submit("scale", 3)
        assert journal.exists() and op.status == "pending"
        before = journal.read_text()
        queue.submit("scale", 5)  # (the API refuses this with 503; the queue must not act on it either)
        time.sleep(1)
        assert ran == [] and journal.read_text() == before
        leader.stop()
        wait_for(standby.holds_lease, 5, "the standby taking over")
        resumed = queue.resume()
        assert [o.id for o in resumed] == [op.id]
        wait_for(lambda: op.id in ran, 10, "the resumed operation running")
        assert queue.wait_idle(10)
        assert f'"id": "{op.id}"' in journal.read_text() and '"succeeded"' in journal.read_text()
    finally:
        queue.stop()
        standby.stop()


def test_a_dead_leader_of_this_machine_is_replaced_at_once(etcd: EtcdConfig) -> None:
    """A manager restarted after `kill -9` finds the key of its predecessor, whose lease still
    runs: the key names a process of this machine that no longer runs, so it is deleted and the
    new one leads at once (a live or paused leader is left to its lease: the other tests)."""
    fleet = fleet_name()
    gone = subprocess.Popen(["sleep", "0"])  # a PID that has exited
    gone.wait()
    me = record_self()
    ghost = LeaderInfo(id="ghost", pid=gone.pid, host=socket.gethostname(), start_time=me.start_time + 1,
                       boot_id=me.boot_id, url="http://ghost:1", epoch=4, since=time.time())
    with EtcdClient(etcd) as client:
        kv = EtcdKv(client)
        lease = kv.grant(60)
        assert kv.txn([], {leader_key(fleet): ghost.to_json(), epoch_key(fleet): "4"}, lease=lease,
                      lease_keys=[leader_key(fleet)])
    b = manager(etcd, fleet, "http://b:2")
    try:
        started = time.monotonic()
        assert b.campaign_once() == 5 and b.leads()
        assert time.monotonic() - started < 5  # not the 60 s of the ghost's lease
    finally:
        b.stop()
