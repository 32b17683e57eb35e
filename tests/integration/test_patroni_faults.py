"""Faults under Patroni, on the shared 3-host sandbox: Patroni inside the guests decides who leads
(its leader key in the sandbox's etcd), the manager only repairs machines. Run by `make test-patroni`
(PGCARVE_IT_ROLES=patroni makes the shared series' fleet Patroni's); not in `make test` yet, where
the manager's own HA loop is still the default and test_faults.py / test_host_failures.py play it.

Runs after test_carve.py on its instance pgc-01 (made here when run alone): a leader and two
replicas, one per host, one of them synchronous (Patroni's strict synchronous mode). Every test
runs a writer through the instance's rw endpoint (one string, taken before the fault) that records
each acknowledged commit, and finds every one on the final primary. Tests run in file order:
(The guests' access rules and a full image pool are roles-agnostic: test_faults.py plays them.)
2. the primary's guest killed with the manager stopped: Patroni alone moves the leader and writes
   go on; the manager started again shows the new leader and starts the killed guest, which
   Patroni rewinds into a replica;
3. both replicas killed: nothing is acknowledged (strict mode names no other standby) and the API
   says writes wait; the manager starts them again and writes go on;
4. a switchover through `pgcarve switchover`, the writer's longest pause reported;
5. the leader's host cut off from the others: a replica takes over once the leader key expires;
   healed, the former leader rejoins as a replica;
6. etcd without quorum: the leader keeps acknowledging (failsafe mode), nobody takes over;
7. the leader's whole host killed with the manager stopped: writes go on elsewhere through the
   same rw string; the host back and the manager started, the former leader's guest rejoins as a
   replica (on three hosts no host is free for a replacement: the manager says so);
8. the leader and its synchronous replica lost together: the last replica, which may lack
   acknowledged commits, is not promoted; both started again, writes go on.
(A lost host's member rebuilt on a spare fourth host, retiring and bringing back are
test_patroni.py's, on a 4-host sandbox of its own.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pgcarve.control.fleet import Fleet
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.errors import DcsUnavailable
from pgcarve.patroni.store import read_cluster
from pgcarve.patroni.view import ClusterView
from pgcarve.processes import stop_pid
from pgcarve.sandbox.faults import SandboxFaults

from tests.integration.conftest import SERIES_ROLES, CarveEnv, wait_for, wait_operation
from tests.support.faults import INSTANCE, api_get, check_nothing_lost, fleet, pgcarve_cli, writer_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(SERIES_ROLES != "patroni", reason="Patroni's fault series: make test-patroni "
                                 "(PGCARVE_IT_ROLES=patroni)")]
__all__ = ["fleet"]  # the fixture, imported for the tests below


@pytest.fixture(scope="module", autouse=True)
def one_instance(carve_env: CarveEnv) -> Iterator[None]:
    """pgc-01 whole under Patroni: left by test_carve.py, or made here when run alone."""
    assert carve_env.config.replication.roles == "patroni", "the fault series plays Patroni's roles"
    names = [d["name"] for d in api_get(carve_env, "/v1/instances")]
    if names != [INSTANCE]:
        scale(carve_env, 1)
    with carve_env.client() as client:  # nothing retired stands in for the pgc-02 made below
        for doc in client.get("/v1/instances", params={"include": "retired"}).json():
            if doc["state"] == "retired":
                resp = client.delete(f"/v1/instances/{doc['name']}", params={"confirm": doc["name"]})
                assert resp.status_code == 200, resp.text
    wait_for(lambda: whole(carve_env), f"{INSTANCE}: a leader and two streaming replicas in etcd", 600)
    yield
    if carve_env.server.poll() is not None:  # a test failed with the manager stopped
        carve_env.restart_server()


def scale(env: CarveEnv, instances: int) -> dict[str, Any]:
    with env.client() as client:
        resp = client.put("/v1/scale", json={"instances": instances})
        assert resp.status_code == 202, resp.text
    done = wait_operation(env, resp.json()["operation"], 1500)
    assert done["status"] == "succeeded", done
    return done


def cluster(env: CarveEnv) -> ClusterView | None:
    """The instance as Patroni's keys say, or None while etcd cannot answer (a member cut off, a
    leader being elected)."""
    assert env.config.etcd is not None
    try:
        with EtcdClient(env.config.etcd) as etcd:
            return read_cluster(etcd, INSTANCE)
    except DcsUnavailable:
        return None


def member(guest: str) -> str:
    """A guest's Patroni member name (its application_name)."""
    return guest.replace("-", "_")


def guest(member_name: str) -> str:
    return member_name.replace("_", "-")


def whole(env: CarveEnv) -> ClusterView | None:
    """The cluster once it has a leader and two streaming replicas, one of them synchronous."""
    view = cluster(env)
    if view is None:
        return None
    replicas = [m for m in view.members if m.name != view.leader and m.replication_state == "streaming"]
    return view if view.leader and len(replicas) == 2 and view.synchronous_standbys else None


def leader_of(env: CarveEnv, fleet: Fleet) -> tuple[str, str]:
    """The leading guest and its host, once the instance is whole."""
    view = wait_for(lambda: whole(env), f"{INSTANCE} whole (a leader, two streaming replicas)", 600)
    name = guest(str(view.leader))
    return name, next(g.host for g in fleet.guests() if g.name == name)


def test_primary_killed_with_the_manager_stopped(carve_env: CarveEnv, fleet: Fleet) -> None:
    old_leader, old_host = leader_of(carve_env, fleet)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before the fault")
        stop_pid(carve_env.server.pid, timeout_s=30)
        killed_at = time.monotonic()
        SandboxFaults(carve_env.sandbox).kill_guest(old_host, old_leader)
        writer.wait_for_acks(20, 180, "commits on a leader elected with the manager stopped")
        writable_s = time.monotonic() - killed_at
        after = cluster(carve_env)
        assert after is not None and after.leader not in (None, member(old_leader)), after
        print(f"{old_leader}'s guest killed, manager stopped: writes acknowledged again after {writable_s:.1f} s "
              f"on {after.leader} (writer's longest pause {writer.longest_gap(killed_at):.1f} s)")

        carve_env.restart_server()
        doc = wait_for(lambda: (d := api_get(carve_env, f"/v1/instances/{INSTANCE}"))["primary"]
                       == guest(str(after.leader)) and d, "the API to show Patroni's new leader", 60)
        assert doc["patroni"]["leader"] == guest(str(after.leader)), doc["patroni"]
        rejoined = wait_for(lambda: (v := whole(carve_env)) and (m := v.member(member(old_leader)))
                            and m.role == "replica" and v, f"{old_leader} started again and rejoined", 600)
        assert rejoined.leader == after.leader, "the restarted former leader took the lead back"
        print(f"{old_leader} started again by the manager, a streaming replica {time.monotonic() - killed_at:.1f} s "
              "after the kill")
        writer.wait_for_acks(20, 120, "commits once whole again")
    check_nothing_lost(fleet, writer)


def test_both_replicas_killed_writes_wait_then_go_on(carve_env: CarveEnv, fleet: Fleet) -> None:
    leader, _ = leader_of(carve_env, fleet)
    replicas = {g.name: g.host for g in fleet.guests() if g.name.startswith(INSTANCE) and g.name != leader}
    assert len(replicas) == 2, replicas
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before the fault")
        killed_at = time.monotonic()
        for name, host in replicas.items():
            SandboxFaults(carve_env.sandbox).kill_guest(host, name)
        doc = wait_for(lambda: (d := api_get(carve_env, f"/v1/instances/{INSTANCE}"))["writes"].startswith("waiting")
                       and d, "the API to say writes wait for a synchronous standby", 120)
        print("while both replicas are down:", doc["writes"])
        # Until a replica streams again nothing may be acknowledged (RPO 0): from the moment the
        # API said so to the one a replica was seen streaming, while the manager restarts them.
        waiting_from = time.monotonic()
        wait_for(lambda: (v := cluster(carve_env)) and any(m.replication_state == "streaming" for m in v.members),
                 "a replica streaming again", 900)
        acked = writer.acked_between(waiting_from, time.monotonic() - 1)
        assert acked <= 1, f"{acked} commits were acknowledged with no replica streaming"
        wait_for(lambda: whole(carve_env), f"{INSTANCE} whole again", 900)
        writer.wait_for_acks(20, 180, "commits after the replicas came back")
        print(f"both replicas back and streaming {time.monotonic() - killed_at:.1f} s after the kill; writes paused "
              f"{writer.longest_gap(killed_at):.1f} s")
    check_nothing_lost(fleet, writer)


def test_switchover_from_the_command_line(carve_env: CarveEnv, fleet: Fleet) -> None:
    old_leader, _ = leader_of(carve_env, fleet)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before the switchover")
        asked_at = time.monotonic()
        run = pgcarve_cli("switchover", INSTANCE, timeout_s=600)
        assert run.returncode == 0, run.stdout + run.stderr
        view = wait_for(lambda: whole(carve_env), f"{INSTANCE} whole after the switchover", 300)
        assert view.leader != member(old_leader), f"{old_leader} still leads: {run.stdout}"
        writer.wait_for_acks(20, 120, "commits after the switchover")
        print(f"switchover {old_leader} -> {view.leader}: writes paused at most {writer.longest_gap(asked_at):.1f} s "
              f"(writer); the command said: {run.stdout.strip().splitlines()[-1] if run.stdout.strip() else '-'}")
    check_nothing_lost(fleet, writer)


def test_leader_host_partitioned_and_healed(carve_env: CarveEnv, fleet: Fleet) -> None:
    """Its etcd member, its replicas and the manager cut off: the leader cannot renew its key, so it
    stops acknowledging; the synchronous replica takes the key once it expires."""
    leader, leader_host = leader_of(carve_env, fleet)
    faults = SandboxFaults(carve_env.sandbox)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before the cut")
        cut_at = time.monotonic()
        faults.partition(leader_host)
        try:
            moved = wait_for(lambda: (v := cluster(carve_env)) and v.leader not in (None, member(leader)) and v,
                             f"a leader other than {leader}", 180)
            writer.wait_for_acks(20, 120, f"commits with {leader_host} cut off")
            print(f"{leader_host} cut off: {moved.leader} leads after {time.monotonic() - cut_at:.1f} s; writes "
                  f"paused {writer.longest_gap(cut_at):.1f} s")
        finally:
            faults.heal(leader_host)
        healed_at = time.monotonic()
        back = wait_for(lambda: (v := whole(carve_env)) and (m := v.member(member(leader))) is not None
                        and m.role == "replica" and v, f"{leader} rejoined after the heal", 300)
        assert back.leader == moved.leader, "the healed former leader took the lead back"
        print(f"{leader} a streaming replica {time.monotonic() - healed_at:.1f} s after the heal")
    check_nothing_lost(fleet, writer)


def test_etcd_without_quorum_the_leader_keeps_serving(carve_env: CarveEnv, fleet: Fleet) -> None:
    leader, _ = leader_of(carve_env, fleet)
    etcd = carve_env.sandbox.etcd
    stopped = [m.name for m in etcd.members()][:2]
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before etcd loses its quorum")
        lost_at = time.monotonic()
        for name in stopped:
            etcd.stop_member(name)
        try:
            writer.wait_for_acks(20, 120, "commits while etcd has no quorum")
            print(f"etcd without quorum ({', '.join(stopped)} stopped): {writer.longest_gap(lost_at):.1f} s at most "
                  "without an acknowledgement")
        finally:
            for name in stopped:
                etcd.start_member(name)
        etcd.wait_healthy()
        view = wait_for(lambda: whole(carve_env), "the instance whole once etcd is back", 180)
        assert view.leader == member(leader), "etcd's outage moved the leader"
    check_nothing_lost(fleet, writer)


def test_leader_host_killed_with_the_manager_stopped(carve_env: CarveEnv, fleet: Fleet) -> None:
    leader, leader_host = leader_of(carve_env, fleet)
    faults = SandboxFaults(carve_env.sandbox)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before the host is lost")
        stop_pid(carve_env.server.pid, timeout_s=30)
        killed_at = time.monotonic()
        faults.kill_host(leader_host)
        try:
            writer.wait_for_acks(20, 180, f"commits elsewhere with {leader_host} lost and no manager")
            after = cluster(carve_env)
            assert after is not None and after.leader not in (None, member(leader)), after
            print(f"{leader_host} killed with the manager stopped: writes acknowledged again on {after.leader} "
                  f"{time.monotonic() - killed_at:.1f} s later (longest pause {writer.longest_gap(killed_at):.1f} s)")
            carve_env.restart_server()
            doc = wait_for(lambda: (d := api_get(carve_env, f"/v1/instances/{INSTANCE}"))["primary"]
                           == guest(str(after.leader)) and d, "the API to show the new leader", 60)
            print("the manager started again, the host still lost:", doc["writes"])
        finally:
            faults.revive_host(leader_host)
        back_at = time.monotonic()
        view = wait_for(lambda: (v := whole(carve_env)) and (m := v.member(member(leader))) is not None
                        and m.role == "replica" and v, f"{leader} back as a replica once {leader_host} is", 900)
        assert view.leader == after.leader, "the former leader took the lead back"
        print(f"{leader_host} back: {leader} a streaming replica {time.monotonic() - back_at:.1f} s later, "
              f"{time.monotonic() - killed_at:.1f} s after the kill")
        writer.wait_for_acks(20, 120, "commits once whole again")
    check_nothing_lost(fleet, writer)


def test_leader_and_synchronous_replica_lost_together(carve_env: CarveEnv, fleet: Fleet) -> None:
    """Strict synchronous mode: only the synchronous replica surely holds every acknowledged
    commit, so with both it and the leader gone the last replica must not be promoted."""
    view = wait_for(lambda: whole(carve_env), f"{INSTANCE} whole", 600)
    leader = guest(str(view.leader))
    [sync] = [guest(m) for m in view.synchronous_standbys]
    last = next(guest(m.name) for m in view.members if guest(m.name) not in (leader, sync))
    hosts = {g.name: g.host for g in fleet.guests()}
    faults = SandboxFaults(carve_env.sandbox)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "commits before the loss")
        stop_pid(carve_env.server.pid, timeout_s=30)  # nothing restarts them while we watch
        lost_at = time.monotonic()
        faults.kill_guest(hosts[sync], sync)
        faults.kill_guest(hosts[leader], leader)
        acked = writer.count
        # Two of Patroni's loops after the leader key has expired (ttl): long enough that a wrong
        # promotion would have happened, read from etcd as it goes.
        watch_until = lost_at + carve_env.config.replication.patroni_ttl_s + \
            2 * carve_env.config.replication.patroni_loop_wait_s
        while time.monotonic() < watch_until:
            now = cluster(carve_env)
            assert now is None or now.leader != member(last), f"{last}, which may lack commits, was promoted"
            time.sleep(1)
        assert writer.count - acked <= 1, "commits were acknowledged with the leader and its synchronous replica gone"
        carve_env.restart_server()
        doc = api_get(carve_env, f"/v1/instances/{INSTANCE}")
        print(f"leader {leader} and synchronous {sync} lost: {last} not promoted; the API said: writes "
              f"{doc['writes']!r}; Patroni: {doc['patroni']['problem']}")
        view = wait_for(lambda: whole(carve_env), f"{INSTANCE} whole once the manager restarted both", 900)
        assert view.leader in (member(leader), member(sync)), f"{view.leader} leads: it may lack commits"
        writer.wait_for_acks(20, 180, "commits after both came back")
        print(f"whole again {time.monotonic() - lost_at:.1f} s after the loss, {view.leader} leading")
    check_nothing_lost(fleet, writer)
