"""Patroni decides roles (replication.roles: patroni), on a 3-host sandbox of its own with etcd:
one instance, a writer recording every acknowledged commit through the instance's rw endpoint.

In sequence, on the one fleet:
1. the manager stopped, then the primary's guest killed: Patroni in the standbys elects the
   synchronous one and writes go on through the unchanged rw string, with no manager at all;
2. the manager started again: it shows the new primary from etcd (not from its own files) and
   repairs the machine only: the killed guest is started again and Patroni makes it a streaming
   replica (rewound);
3. a switchover through the API, which asks Patroni: the pause is reported;
4. the leader's host cut off from the others: a standby takes over once the leader key expires;
   healed, the old leader rejoins as a replica;
5. etcd without quorum (two of four members stopped): the leader keeps acknowledging commits
   (failsafe mode: it still reaches every member) and no failover happens;
6. a replica's whole host lost, the manager running: after host_timeout_s the manager builds a
   member on h3, the one host holding none of the instance's guests, and Patroni clones it from
   a replica; the host back, its guest is removed (never started) since its replacement streams;
7. scaled down to none: the instance is retired under the writer (writes refused, a synchronous
   standby caught up, its guests gone), its disks and Patroni keys kept;
8. scaled up again: its members boot from their disks, Patroni elects a leader from the kept
   keys and the writer's unchanged rw string writes again;
9. every acknowledged commit is on the final primary; retired again and purged, the instance
   leaves no disk and no key in etcd.
Four hosts: h0 for primaries, h1 and h2 for the instance's standbys, h3 its spare.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pgcarve.config import FleetConfig
from pgcarve.control.fleet import Fleet
from pgcarve.control.removal import leftovers
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.errors import DcsUnavailable
from pgcarve.patroni.store import read_cluster
from pgcarve.patroni.view import ClusterView
from pgcarve.processes import stop_pid
from pgcarve.sandbox.faults import SandboxFaults

from tests.integration.conftest import (
    SANDBOX_LOGS,
    CarveEnv,
    clean_sandbox,
    free_port,
    series_config,
    start_server,
    wait_for,
    wait_operation,
)
from tests.support.faults import INSTANCE, api_get, check_nothing_lost, writer_for

pytestmark = pytest.mark.integration

STATE_DIR = Path(os.environ.get("PGCARVE_IT_PATRONI_STATE", "/var/tmp/pgcarve-it-patroni"))


@pytest.fixture(scope="module")
def env() -> Iterator[CarveEnv]:
    paths, sandbox = clean_sandbox(STATE_DIR)
    raw = series_config(sandbox.up(4)).model_dump(mode="json")
    raw["replication"]["roles"] = "patroni"
    config = FleetConfig.model_validate(raw)
    hosts_file = STATE_DIR / "hosts-patroni.yaml"
    hosts_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    port = free_port()
    try:
        server = start_server(port, hosts_file, state_dir=STATE_DIR)
    except BaseException:
        sandbox.down()
        raise
    carve = CarveEnv(paths=paths, config=config, sandbox=sandbox, url=f"http://127.0.0.1:{port}", server=server,
                     hosts_file=hosts_file)
    try:
        yield carve
    finally:
        left = carve.teardown(keep_logs=SANDBOX_LOGS / "patroni")
        assert left == [], f"the Patroni sandbox's teardown left: {left}"
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert sandbox.tag not in namespaces, f"a namespace of sandbox {sandbox.tag} survived: {namespaces}"


def cluster(env: CarveEnv) -> ClusterView:
    assert env.config.etcd is not None
    with EtcdClient(env.config.etcd) as etcd:
        view = read_cluster(etcd, INSTANCE)
    assert view is not None, f"{INSTANCE} has no Patroni keys in etcd"
    return view


def cluster_if_readable(env: CarveEnv) -> ClusterView | None:
    """The cluster, or None while etcd cannot answer (a member cut off, a leader being elected)."""
    try:
        return cluster(env)
    except DcsUnavailable:
        return None


def member(guest: str) -> str:
    """A guest's Patroni member name (its application_name)."""
    return guest.replace("-", "_")


def whole(env: CarveEnv) -> ClusterView | None:
    """The cluster once it has a leader and two streaming replicas, one of them synchronous."""
    view = cluster_if_readable(env)
    if view is None:
        return None
    replicas = [m for m in view.members if m.name != view.leader and m.replication_state == "streaming"]
    return view if view.leader and len(replicas) == 2 and view.synchronous_standbys else None


def test_patroni_fails_over_without_the_manager_and_the_manager_follows(env: CarveEnv) -> None:
    with env.client() as client:
        op = client.put("/v1/scale", json={"instances": 1}).json()["operation"]
    done = wait_operation(env, op)
    assert done["status"] == "succeeded", done
    view = wait_for(lambda: whole(env), f"{INSTANCE}: a leader and two streaming replicas in etcd", 300)
    assert view.leader == "pgc_01" and view.settings is not None and view.settings.synchronous_mode_strict
    assert view.settings.failsafe_mode, "failsafe_mode is off"

    fleet = Fleet(env.config, env.paths)
    writer = writer_for(env, fleet)
    try:
        with writer:
            writer.wait_for_acks(20, 120, "commits before the fault")

            # 1. No manager, and the primary's guest gone: Patroni alone moves the leader.
            stop_pid(env.server.pid, timeout_s=30)
            killed_at = time.monotonic()
            SandboxFaults(env.sandbox).kill_guest("h0", INSTANCE)
            writer.wait_for_acks(20, 180, "commits on a new leader elected with the manager stopped")
            writable_s = time.monotonic() - killed_at
            after = cluster(env)
            assert after.leader not in (None, "pgc_01"), after.leader
            print(f"primary's guest killed, manager stopped: writes acknowledged again after {writable_s:.1f} s "
                  f"on {after.leader}")

            # 2. The manager again: it shows Patroni's leader and starts the killed guest again.
            env.restart_server()
            doc = wait_for(lambda: (d := api_get(env, f"/v1/instances/{INSTANCE}"))["primary"] not in (None, INSTANCE)
                           and d, "the API to show the new primary", 60)
            assert doc["primary"] == after.leader.replace("_", "-")
            rejoined = wait_for(lambda: (v := whole(env)) and v.member("pgc_01") and v, "pgc-01 rejoined", 600)
            assert rejoined.member("pgc_01").role == "replica" and rejoined.leader == after.leader
            print(f"pgc-01 started again by the manager and rejoined as a replica after "
                  f"{time.monotonic() - killed_at:.1f} s")

            # 3. A switchover through the API, done by Patroni.
            asked_at = time.monotonic()
            with env.client() as client:
                op = client.post(f"/v1/instances/{INSTANCE}/switchover", json={}).json()["operation"]
            done = wait_operation(env, op, 300)
            assert done["status"] == "succeeded", done
            result = done["result"]
            assert isinstance(result, dict) and result["new_primary"] != doc["primary"]
            writer.wait_for_acks(20, 120, "commits after the switchover")
            print(f"switchover to {result['new_primary']}: writes paused at most {result['write_pause_s']} s by the "
                  f"API's count, {writer.longest_gap(asked_at):.1f} s without an acknowledgement by the writer's")

            # 4. The leader's host cut off from the others (its etcd member, its standbys, the
            # manager): the leader cannot renew its key nor reach its members, so it stops
            # acknowledging; the synchronous standby takes the key once it expires; healed, the
            # old leader rejoins as a replica (rewound).
            # Not before the new leader has named its synchronous standby: until then (a few seconds
            # after a promotion) strict mode knows no member that surely holds every acknowledged
            # commit, and Patroni rightly promotes nobody when the leader is lost.
            leader_guest, leader_host = str(result["new_primary"]), str(result["host"])
            settled = wait_for(lambda: (v := whole(env)) and v.leader == member(leader_guest) and v,
                               f"{leader_guest} leading with a synchronous standby named", 120)
            print(f"after the switchover, {settled.synchronous_standbys} named synchronous "
                  f"{time.monotonic() - asked_at:.1f} s after it was asked")
            faults = SandboxFaults(env.sandbox)
            cut_at = time.monotonic()
            faults.partition(leader_host)
            try:
                moved = wait_for(lambda: (v := cluster_if_readable(env))
                                 and v.leader not in (None, member(leader_guest)) and v,
                                 f"a leader other than {leader_guest}", 180)
                writer.wait_for_acks(20, 120, f"commits with {leader_host} cut off")
                print(f"{leader_host} cut off: {moved.leader} leads after {time.monotonic() - cut_at:.1f} s; writes "
                      f"paused {writer.longest_gap(cut_at):.1f} s")
            finally:
                faults.heal(leader_host)
            healed_at = time.monotonic()
            back = wait_for(lambda: (v := whole(env)) and (m := v.member(member(leader_guest))) is not None
                            and m.role == "replica" and v, f"{leader_guest} rejoined after the heal", 300)
            assert back.leader == moved.leader, "the healed former leader took the lead back"
            print(f"{leader_guest} rejoined as a replica {time.monotonic() - healed_at:.1f} s after the heal")

            # 5. etcd without quorum (two of its four members stopped): nobody can renew or take a
            # key, but the leader reaches every member of its instance (failsafe mode), so it
            # keeps acknowledging commits, and no failover happens.
            before = cluster(env).leader
            stopped = [m.name for m in env.sandbox.etcd.members()][:2]
            lost_at = time.monotonic()
            for name in stopped:
                env.sandbox.etcd.stop_member(name)
            try:
                writer.wait_for_acks(20, 120, "commits while etcd has no quorum")
                print(f"etcd without quorum: {writer.longest_gap(lost_at):.1f} s at most without an acknowledgement")
            finally:
                for name in stopped:
                    env.sandbox.etcd.start_member(name)
            env.sandbox.etcd.wait_healthy()
            assert wait_for(lambda: (v := cluster_if_readable(env)) and v.leader, "a leader once etcd is back",
                            120) == before, \
                "etcd's outage moved the leader"

            # 6. A replica's whole host lost: the manager builds a member on the spare host h3;
            # the host back, its guest goes once the replacement streams.
            leader_now = cluster(env).leader
            hosts = {g.name: g.host for g in fleet.guests()}
            victim = next(name for name, host in sorted(hosts.items())
                          if member(name) != leader_now and host != hosts[str(leader_now).replace("_", "-")])
            lost_host = hosts[victim]
            lost_at = time.monotonic()
            faults.kill_host(lost_host)
            try:
                rebuilt = wait_for(lambda: (v := whole(env)) and v.member("pgc_01_s3") and v,
                                   "pgc-01-s3 streaming on the spare host h3", 600)
                writer.wait_for_acks(20, 120, f"commits with {lost_host} lost")
                print(f"{lost_host} lost ({victim}): pgc-01-s3 built on h3 and streaming "
                      f"{time.monotonic() - lost_at:.1f} s later; writes paused {writer.longest_gap(lost_at):.1f} s")
                assert {g.name: g.host for g in fleet.guests()}["pgc-01-s3"] == "h3"
                # The rw string the writer took at the start lists pgc-01-s3 already (one name
                # per standby host: control/endpoints.py).
                assert rebuilt.leader == leader_now, "losing a replica moved the leader"
            finally:
                faults.revive_host(lost_host)
            back_at = time.monotonic()
            wait_for(lambda: victim not in {g.name for g in fleet.guests()},
                     f"{victim} removed from {lost_host} once its host is back", 300)
            view = wait_for(lambda: whole(env), f"{INSTANCE} whole on its three remaining hosts", 120)
            assert victim.replace("-", "_") not in {m.name for m in view.members}
            print(f"{victim} removed {time.monotonic() - back_at:.1f} s after {lost_host} came back")

            # 7. Retired under the writer: its guests go, its disks and keys stay.
            retire_at = time.monotonic()
            assert "retired 1 (disks kept)" in str(scale(env, 0)["message"]), "not retired"
            acked_when_retired = writer.count
            assert [g.name for g in fleet.guests()] == [], "a retired instance keeps no guest running"
            with env.client() as client:
                [retired] = client.get("/v1/instances", params={"include": "retired"}).json()
            assert retired["state"] == "retired" and retired["disk_mib"] > 0, retired
            kept = cluster(env)
            assert kept.system_identifier and kept.sync is not None, "its Patroni keys were removed"
            print(f"retired in {time.monotonic() - retire_at:.1f} s with {acked_when_retired} commits acknowledged")

            # 8. Back: Patroni gives the roles, the rw string writes again.
            back_at = time.monotonic()
            assert "brought back 1 from retirement" in str(scale(env, 1)["message"])
            again = wait_for(lambda: whole(env), f"{INSTANCE} back with a leader and two streaming replicas", 300)
            writer.wait_for_acks(20, 180, "commits after coming back")
            assert writer.count > acked_when_retired
            print(f"brought back in {time.monotonic() - back_at:.1f} s: {again.leader} leads, timeline "
                  f"{again.timeline}; writes again {writer.longest_gap(retire_at):.1f} s after the retirement began")
    finally:
        writer.stop()
    check_nothing_lost(fleet, writer)
    print(f"{writer.count} commits acknowledged through every step, none lost")

    # 9. Retired again and purged: no disk, no key.
    scale(env, 0)
    with env.client() as client:
        purged = client.delete(f"/v1/instances/{INSTANCE}", params={"confirm": INSTANCE})
    assert purged.status_code == 200, purged.text
    assert [v for v in leftovers(fleet) if INSTANCE in v] == [], "the purged instance left volumes"
    fleet.close()
    assert env.config.etcd is not None
    with EtcdClient(env.config.etcd) as etcd:
        assert read_cluster(etcd, INSTANCE) is None, "the purged instance's Patroni keys are still in etcd"


def scale(env: CarveEnv, instances: int) -> dict[str, object]:
    with env.client() as client:
        op = client.put("/v1/scale", json={"instances": instances}).json()["operation"]
    done = wait_operation(env, op, 900)
    assert done["status"] == "succeeded", done
    return done
