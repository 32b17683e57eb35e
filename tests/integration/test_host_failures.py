"""Failover where the layout matters: a planned switchover, the primary's whole host lost (with
the manager killed at every step of the failover), the primary's host cut off from the others,
and the primary lost together with its synchronous standby. Each with a writer that records every
acknowledged commit and checks them all on the final primary.

Runs after test_faults.py on pgc-01 (a primary and two standbys, one per sandbox host), with the
manager restarted on a hosts file of short timeouts (host_timeout_s, fence_after_s) so each fault
resolves in seconds rather than half-minutes. Every test leaves pgc-01 whole again: a former
primary rejoins as a standby (pg_rewind), its disk kept.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import yaml
from pgcarve.control.fleet import Fleet
from pgcarve.sandbox.faults import SandboxFaults
from psycopg.conninfo import make_conninfo

from tests.integration.conftest import IT_STATE, CarveEnv, wait_for, wait_operation
from tests.support.faults import (
    INSTANCE,
    api_get,
    check_nothing_lost,
    fleet,
    pgcarve_cli,
    rw_endpoint,
    wait_whole,
    writer_for,
)

pytestmark = pytest.mark.integration
__all__ = ["fleet"]  # the fixture, imported for the tests below

SHORT = {"host_timeout_s": 10, "fence_after_s": 15, "sync_switch_after_s": 3}
FAILOVER_STEPS = ("failover.fenced", "failover.recorded", "failover.configured", "failover.followed",
                  "failover.promoted")


@pytest.fixture(scope="module", autouse=True)
def short_timeouts(carve_env: CarveEnv) -> Iterator[None]:
    """pgc-01 whole, under a manager whose hosts file has short fault timeouts."""
    names = [d["name"] for d in api_get(carve_env, "/v1/instances")]
    if names != [INSTANCE]:
        with carve_env.client() as client:
            resp = client.put("/v1/scale", json={"instances": 1})
            assert resp.status_code == 202, resp.text
            assert wait_operation(carve_env, resp.json()["operation"], 1200)["status"] == "succeeded"
    raw = carve_env.config.model_dump(mode="json")
    raw["recovery"].update(primary="restart", enabled=True, **SHORT)  # and the series' timers
    (IT_STATE / "hosts-ha.yaml").write_text(yaml.safe_dump(raw))
    carve_env.restart_server(hosts_file=IT_STATE / "hosts-ha.yaml")
    wait_whole(carve_env, 900)
    yield
    carve_env.restart_server()


def instance_doc(env: CarveEnv) -> dict[str, Any]:
    return dict(api_get(env, f"/v1/instances/{INSTANCE}"))


def one_primary(fleet: Fleet) -> str:
    """The instance's only guest whose metadata says primary (never two writable primaries)."""
    inst = fleet.instance(INSTANCE)
    primaries = [g.name for g in inst.guests if g.info.metadata.role == "primary"]
    assert len(primaries) == 1 and inst.primary is not None and primaries == [inst.primary.name], primaries
    return primaries[0]


def run_operation(env: CarveEnv, path: str, body: dict[str, object], timeout_s: float = 900) -> dict[str, Any]:
    with env.client() as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 202, resp.text
        return dict(wait_operation(env, resp.json()["operation"], timeout_s))


def test_switchover_under_a_writer(carve_env: CarveEnv, fleet: Fleet) -> None:
    """`pgcarve switchover` as an operator types it: the synchronous standby takes over with nothing
    lost; the pause is measured; the old primary rejoins as a standby."""
    before = wait_whole(carve_env)
    sync = next(s["name"] for s in before["standbys"] if s["sync_state"] == "sync")
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the switchover")
        done = pgcarve_cli("switchover", INSTANCE, timeout_s=900)
        assert done.returncode == 0, done.stdout + done.stderr
        said = " ".join(done.stdout.split())
        print(f"pgcarve switchover {INSTANCE}: {said}")
        pause = re.search(r"writes paused ([0-9.]+) s", said)
        assert pause is not None and f"new primary {sync} on" in said, said
        assert 0 < float(pause.group(1)) < 300
        after = instance_doc(carve_env)
        assert after["host"] != before["host"]
        writer.wait_for_acks(50, 300, "writes after the switchover")
        doc = wait_whole(carve_env, 900)  # the old primary rejoined as a standby
        assert doc["host"] == after["host"]
    check_nothing_lost(fleet, writer)
    assert one_primary(fleet) == sync


def test_primary_host_lost_with_the_manager_killed_at_every_step(carve_env: CarveEnv, fleet: Fleet) -> None:
    """The primary's host loses every process at once. Its primary fails over to a standby on
    another host after host_timeout_s, while the manager is killed (as kill -9 would) at each
    step of the failover and started again: it finishes the same failover, never a second one.
    When the host comes back, its former primary rejoins as a standby."""
    faults = SandboxFaults(carve_env.sandbox)
    lost = instance_doc(carve_env)["host"]
    armed = {"PGCARVE_FAILPOINTS": ",".join(FAILOVER_STEPS), "PGCARVE_FAILPOINT_DIR": str(IT_STATE / "failpoints")}
    (IT_STATE / "failpoints").mkdir(exist_ok=True)
    for marker in (IT_STATE / "failpoints").glob("*"):
        marker.unlink()
    carve_env.restart_server(hosts_file=IT_STATE / "hosts-ha.yaml", extra_env=armed)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the host is lost")
        killed_at = time.time()
        print(f"killing host {lost}: {faults.kill_host(lost)} processes")
        restarts = 0

        def moved() -> bool:
            nonlocal restarts
            if carve_env.server.poll() is not None:  # a failpoint stopped it: start it again
                restarts += 1
                carve_env.restart_server(hosts_file=IT_STATE / "hosts-ha.yaml", extra_env=armed)
            try:
                doc = instance_doc(carve_env)
            except Exception:
                return False
            return bool(doc["host"] != lost and doc["writes"] == "accepted")

        wait_for(moved, f"{INSTANCE} writable on another host than {lost}", 900)
        print(f"writable on {instance_doc(carve_env)['host']} {time.time() - killed_at:.0f} s after {lost} was "
              f"killed, the manager restarted {restarts} times on the way")
        fired = sorted(p.name for p in (IT_STATE / "failpoints").glob("*.fired"))
        assert restarts == len(FAILOVER_STEPS) and len(fired) == len(FAILOVER_STEPS), fired
        writer.wait_for_acks(50, 300, "writes after the failover")
        faults.revive_host(lost)
        doc = wait_whole(carve_env, 900)
        print(f"whole again {time.time() - killed_at:.0f} s after the host was killed: {doc['standbys']}")
        assert lost in {s["host"] for s in doc["standbys"]}, "the former primary should rejoin as a standby"
    check_nothing_lost(fleet, writer)
    assert writer.dsn() == rw_endpoint(carve_env), "the rw string is the same after the failover"
    one_primary(fleet)
    carve_env.restart_server(hosts_file=IT_STATE / "hosts-ha.yaml")  # failpoints disarmed


def test_primary_host_partitioned(carve_env: CarveEnv, fleet: Fleet) -> None:
    """The primary's host is cut off from the others (its guests keep running). The primary
    cannot acknowledge a commit after the cut; the manager fails over to a standby; after the
    partition heals the old primary rejoins as a standby."""
    faults = SandboxFaults(carve_env.sandbox)
    cut = instance_doc(carve_env)
    password = fleet.credentials.admin_password
    old_dsn = make_conninfo(cut["dsn"], password=password, connect_timeout=5)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the partition")
        old = psycopg.connect(old_dsn, autocommit=True)
        faults.partition(cut["host"])
        cut_at = time.time()
        outcome: list[object] = []

        def commit_on_the_old_primary() -> None:
            try:
                old.execute("create table if not exists partition_probe (at timestamptz)")
                old.execute("insert into partition_probe values (now())")
                outcome.append("acknowledged")
            except psycopg.Error as exc:
                outcome.append(exc)

        probe = threading.Thread(target=commit_on_the_old_primary, daemon=True)
        probe.start()
        probe.join(8)
        # Within 8 s the commit has either failed (an error is no acknowledgement: the session
        # may end as the guest fences itself) or still waits; it must not be acknowledged.
        assert "acknowledged" not in outcome, f"the cut-off primary acknowledged a commit: {outcome}"
        wait_for(lambda: instance_doc(carve_env)["host"] != cut["host"],
                 "a failover away from the partitioned host", 600)
        print(f"failed over from {cut['host']} to {instance_doc(carve_env)['host']} "
              f"{time.time() - cut_at:.0f} s after the cut")
        writer.wait_for_acks(50, 300, "writes after the failover")
        probe.join(120)
        assert outcome and outcome[0] != "acknowledged", outcome
        faults.heal(cut["host"])
        doc = wait_whole(carve_env, 900)
        assert cut["host"] in {s["host"] for s in doc["standbys"]}
    old.close()
    check_nothing_lost(fleet, writer)
    one_primary(fleet)


def test_primary_and_sync_standby_lost_together(carve_env: CarveEnv, fleet: Fleet) -> None:
    """FIRST 1: the primary's host and the synchronous standby's host are lost together. The
    remaining standby cannot be proven to hold every acknowledged commit, so nothing is promoted
    and the incident says why; a forced failover to it works and says what may be missing. When
    the hosts come back, both rejoin as standbys."""
    faults = SandboxFaults(carve_env.sandbox)
    doc = wait_whole(carve_env)
    sync = next(s for s in doc["standbys"] if s["sync_state"] == "sync")
    other = next(s for s in doc["standbys"] if s["name"] != sync["name"])
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the loss")
    # Everything acknowledged so far replayed on the remaining standby, so the forced promotion
    # below loses nothing the writer saw acknowledged (it cannot prove that by itself).
    wait_for(lambda: all(s["replay_lag_bytes"] == 0 for s in instance_doc(carve_env)["standbys"]),
             "both standbys replayed everything", 120)
    lost_at = time.time()
    for host in (doc["host"], sync["host"]):
        faults.kill_host(host)

    def refused() -> dict[str, Any] | None:
        found = [i for i in api_get(carve_env, "/v1/incidents")
                 if i["instance"] == INSTANCE and i["detected_at"] >= lost_at and i["status"] == "failed"
                 and "must answer" in i["message"]]
        return found[0] if found else None

    incident = wait_for(refused, "the incident saying the standby cannot be proven", 300)
    print(f"not promoted: {incident['message']}")
    assert sync["name"] in incident["message"] and "force" in incident["message"]
    assert instance_doc(carve_env)["host"] == doc["host"], "nothing may be promoted automatically"
    op = run_operation(carve_env, f"/v1/instances/{INSTANCE}/failover", {"to": other["name"], "force": True})
    assert op["status"] == "succeeded", op
    print(f"forced failover to {other['name']}: may be missing: {op['result']['may_be_missing']}")
    assert op["result"]["new_primary"] == other["name"] and op["result"]["proven"] is False
    assert sync["name"] in str(op["result"]["may_be_missing"])
    for host in (doc["host"], sync["host"]):
        faults.revive_host(host)
    whole = wait_whole(carve_env, 1200)
    print(f"whole again {time.time() - lost_at:.0f} s after the loss: {whole['standbys']}")
    with writer_for(carve_env, fleet) as after:
        after.wait_for_acks(50, 300, "writes on the promoted standby")
    check_nothing_lost(fleet, writer)
    check_nothing_lost(fleet, after)
    one_primary(fleet)
