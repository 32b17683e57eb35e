"""Faults in the shared 3-host sandbox, each with a writer that records every acknowledged commit
and checks, after recovery, that every one is present. (The manager killed in the middle of a
scale-up, with every libvirtd restarted, is played in test_carve.py while pgc-02 is first built.)

Runs after test_carve.py, on its instance pgc-01 (primary on h0, standbys s1 on h1 and s2 on h2,
`FIRST 1 (pgc_01_s1, pgc_01_s2)`, synchronous_commit remote_write). Tests run in file order:
1. the primary's QEMU killed -> lifecycle event within 2 s -> restarted from its disk;
2. the sync standby killed -> the potential standby takes over; then both standbys lost (one
   with its disk gone) -> writes wait, status says why -> one restarted, one rebuilt;
3. the image pool full during scale-up -> clear error, nothing half-made;
4. policy failover: libvirtd restarted under a running manager (events reconnect), then the
   primary killed -> the standby with the most WAL promoted, DSN moved, new standby built.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from pgcarve.config import FleetConfig
from pgcarve.control.fleet import Fleet
from pgcarve.control.removal import leftovers
from pgcarve.control.scaler import Scaler
from pgcarve.errors import CapacityError
from pgcarve.sandbox.faults import SandboxFaults

from tests.integration.conftest import IT_STATE, TOKEN, CarveEnv, wait_for, wait_operation
from tests.support.faults import (
    INSTANCE,
    api_get,
    check_nothing_lost,
    fleet,
    incidents_for,
    pgcarve_cli,
    rw_endpoint,
    wait_recovered,
    wait_watching,
    wait_whole,
    writer_for,
)
from tests.support.prometheus import prometheus_watching

pytestmark = pytest.mark.integration
__all__ = ["fleet"]  # the fixture, imported for the tests below



@pytest.fixture(scope="module", autouse=True)
def one_instance(carve_env: CarveEnv) -> None:
    """pgc-01 with its two standbys: left by test_carve.py, or made here when run alone."""
    names = [d["name"] for d in api_get(carve_env, "/v1/instances")]
    with carve_env.client() as client:
        if names != [INSTANCE]:
            resp = client.put("/v1/scale", json={"instances": 1})
            assert resp.status_code == 202, resp.text
            op = wait_operation(carve_env, resp.json()["operation"], 1200)
            assert op["status"] == "succeeded", op
        # Tests here create pgc-02 anew: nothing retired may stand in for it.
        for doc in client.get("/v1/instances", params={"include": "retired"}).json():
            if doc["state"] == "retired":
                resp = client.delete(f"/v1/instances/{doc['name']}", params={"confirm": doc["name"]})
                assert resp.status_code == 200, resp.text


def sync_standby(fleet: Fleet) -> str | None:
    """The guest name of the primary's synchronous standby; None while it has none (between a
    standby's death and the next one being named)."""
    inst = fleet.instance(INSTANCE)
    assert inst.primary is not None
    with fleet.connect(inst.primary) as conn:
        rows = conn.execute("select application_name from pg_stat_replication where sync_state = 'sync'").fetchall()
    assert len(rows) <= 1, rows
    return str(rows[0][0]).replace("_", "-") if rows else None


def test_guest_postgres_security(carve_env: CarveEnv, fleet: Fleet) -> None:
    """SCRAM only over TLS only, a replication role that is nothing else, pg_hba limited to the
    instance networks (replication: to the instance's own guests), dead clients noticed, and the
    API token nowhere in the server's log."""
    inst = fleet.instance(INSTANCE)
    for guest in (inst.primary, *inst.standbys):
        assert guest is not None
        with fleet.connect(guest) as conn:
            assert conn.execute("show password_encryption").fetchone() == ("scram-sha-256",)
            # A vanished client's backend goes within about half a minute (test_dead_clients_local.py).
            dead_clients = conn.execute("select current_setting('tcp_keepalives_idle'), "
                                        "current_setting('tcp_user_timeout'), "
                                        "current_setting('client_connection_check_interval')").fetchone()
            assert dead_clients == ("10", "30000", "10s"), dead_clients
            rules = conn.execute("select type, database, user_name, address, netmask, auth_method "
                                 "from pg_hba_file_rules").fetchall()
            host_rules = [r for r in rules if r[0] != "local"]
            assert host_rules and {r[5] for r in host_rules} == {"scram-sha-256"}, rules
            assert {r[0] for r in host_rules} == {"hostssl"}, rules
            allowed = {"127.0.0.1", "10.77.0.0", "10.76.0.0"}
            # The replication role's rules (streaming, and database postgres for pg_rewind) name
            # the instance's other guests, one address each; every other rule a configured network.
            assert {r[3] for r in host_rules if r[2] != ["replicator"]} <= allowed, rules
            others = {g.address for g in (inst.primary, *inst.standbys) if g is not None and g.name != guest.name}
            assert {r[3] for r in host_rules if r[2] == ["replicator"]} <= others, rules
            assert all(r[1] in (["replication"], ["postgres"]) for r in host_rules if r[2] == ["replicator"]), rules
            assert all(r[2] == ["replicator"] for r in host_rules if r[1] == ["replication"]), rules
            roles: dict[str, bool] = dict(conn.execute("select rolname, rolsuper from pg_roles where rolname in "
                                      "('pgcarve', 'replicator')").fetchall())
            assert roles == {"pgcarve": True, "replicator": False}
            repl = conn.execute("select rolreplication, rolcanlogin from pg_roles "
                                "where rolname = 'replicator'").fetchone()
            assert repl == (True, True)
            verifier = conn.execute("select rolpassword from pg_authid where rolname = 'pgcarve'").fetchone()
            assert verifier is not None and str(verifier[0]).startswith("SCRAM-SHA-256$")
    assert TOKEN not in (IT_STATE / "server.log").read_text(errors="replace")


def test_primary_killed_is_restarted(carve_env: CarveEnv, fleet: Fleet, tmp_path: Path) -> None:
    """The primary's QEMU killed: detected from the event, restarted, nothing lost; and a real
    Prometheus with pgcarve's rules sees PgcarveInstanceDown fire, then resolve after the repair."""
    wait_watching(carve_env)
    with prometheus_watching(tmp_path, carve_env.url) as prom, writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the fault")
        assert not prom.find_alerts("PgcarveInstanceDown", {"instance": INSTANCE}), prom.alerts()
        killed_at = time.time()
        kill_guest(carve_env, "h0", INSTANCE)
        incident = wait_for(lambda: incidents_for(carve_env, INSTANCE, killed_at), "the fault to be detected", 30)[0]
        latency = incident["detected_at"] - killed_at
        print(f"primary QEMU killed: detected from a libvirt event after {latency * 1000:.0f} ms: {incident}")
        # An event, not the 15 s sweep; how soon is a figure (the aim is 2 s), not a bound here.
        assert incident["source"] == "event" and incident["role"] == "primary"
        alert = prom.wait_for_alert("PgcarveInstanceDown", {"instance": INSTANCE}, "firing", timeout_s=120)
        print(f"PgcarveInstanceDown firing {time.time() - killed_at:.1f} s after the kill: "
              f"{alert['annotations']['summary']}")
        recovered = wait_recovered(carve_env, INSTANCE, killed_at)
        assert recovered["action"] == "restart", recovered
        print(f"recovered {recovered['finished_at'] - killed_at:.1f} s after the kill: {recovered['message']}")
        listed = pgcarve_cli("incidents", "--instance", INSTANCE, "--json")  # what an operator paged at night runs
        assert listed.returncode == 0, listed.stderr
        assert recovered["id"] in {i["id"] for i in json.loads(listed.stdout) if i["status"] == "recovered"}
        wait_whole(carve_env)
        prom.wait_for_no_alert("PgcarveInstanceDown", {"instance": INSTANCE}, timeout_s=120)
        print(f"PgcarveInstanceDown resolved {time.time() - killed_at:.1f} s after the kill")
        writer.wait_for_acks(50, 300, "writes after the primary came back")
    check_nothing_lost(fleet, writer)


def kill_guest(env: CarveEnv, host: str, guest: str) -> None:
    """kill -9 the guest's QEMU process, by the PID libvirt recorded for it."""
    SandboxFaults(env.sandbox).kill_guest(host, guest)


def test_standbys_killed_writes_wait_then_standbys_come_back(carve_env: CarveEnv, fleet: Fleet) -> None:
    wait_watching(carve_env)
    hosts = {s.name: s.info.host for s in fleet.instance(INSTANCE).standbys}
    first = sync_standby(fleet)
    assert first is not None, "no synchronous standby before the fault"
    other = next(name for name in hosts if name != first)
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the fault")
        # 1. The sync standby dies: the potential standby becomes sync and commits go on.
        killed_at = time.time()
        kill_guest(carve_env, hosts[first], first)
        # The primary first notices the dead standby (wal_sender_timeout, 10 s), then the manager
        # waits sync_switch_after_s; under emulation, beside the killed guest's restart.
        wait_for(lambda: sync_standby(fleet) == other, f"{other} to become the synchronous standby", 180)
        writer.wait_for_acks(30, 120, f"writes with {first} down")
        wait_recovered(carve_env, first, killed_at)
        wait_whole(carve_env)

        # 2. Both standbys lost, one with its disk: nothing may commit (RPO 0) and status says why.
        fleet.hosts[hosts[other]].storage.delete_volume(f"{other}.qcow2")  # QEMU keeps the open file until killed
        killed_at = time.time()
        for name, host in hosts.items():
            kill_guest(carve_env, host, name)
        doc = wait_for(lambda: (d := api_get(carve_env, f"/v1/instances/{INSTANCE}"))["writes"].startswith("waiting")
                       and d, "status to say writes are waiting", 60)
        print("status while both standbys are down:", doc["writes"])
        stalled_at = writer.count
        window_end = time.monotonic() + 5
        while time.monotonic() < window_end:  # the standbys are still booting: nothing may be acknowledged
            time.sleep(0.5)
        assert writer.count - stalled_at <= 1, "commits were acknowledged with no synchronous standby"
        recovered_first = wait_recovered(carve_env, first, killed_at, 900)
        recovered_other = wait_recovered(carve_env, other, killed_at, 900)
        print("standby recoveries:", recovered_first["message"], "|", recovered_other["message"])
        assert "rebuilt" in recovered_other["message"], recovered_other
        wait_whole(carve_env, 900)
        writer.wait_for_acks(50, 300, "writes after the standbys came back")
    check_nothing_lost(fleet, writer)


def test_disk_full_during_scale_up_leaves_nothing(carve_env: CarveEnv, fleet: Fleet) -> None:
    """h0's pool on a small tmpfs: first refused up front (free space below the reserve), then,
    with no reserve, the new guest's disk fills while it boots. Both fail with an error that says
    so, and leave no guest and no volume of pgc-02 behind."""
    sandbox = carve_env.sandbox
    path = "/var/lib/libvirt/pgcsmall"
    SandboxFaults(sandbox).run_in_host("h0", ["mkdir", "-p", path])
    SandboxFaults(sandbox).run_in_host("h0", ["mount", "-t", "tmpfs", "-o", "size=320m", "pgcarve-test-small", path])
    raw = carve_env.config.model_dump(mode="json")
    raw["hosts"][0].update(pool="pgcsmall", pool_path=path)
    small = Fleet(FleetConfig.model_validate(raw), carve_env.paths)
    try:
        small.images.on("h0")  # the base image takes ~230 MiB of the 320
        free = small.hosts["h0"].storage.pool_free_mib()
        filler = max(0, free - 3) * 1024 * 1024
        SandboxFaults(sandbox).run_in_host("h0", ["fallocate", "-l", str(filler), f"{path}/filler"])
        small.hosts["h0"].storage.pool_free_mib()
        before = sorted(g.name for g in small.guests())

        with pytest.raises(CapacityError) as refused:
            Scaler(small).scale(2)
        print("refused up front:", refused.value)
        assert "storage pool pgcsmall" in str(refused.value) and "MiB free" in str(refused.value)
        assert sorted(g.name for g in small.guests()) == before

        raw["instance"]["disk_reserve_mib"] = 0
        unreserved = Fleet(FleetConfig.model_validate(raw), carve_env.paths)
        try:
            with pytest.raises(Exception) as failed:
                Scaler(unreserved).scale(2)
            message = str(failed.value)
            print("scale-up with a full disk failed:", message)
            assert any(word in message for word in ("space", "full")), message
            assert sorted(g.name for g in unreserved.guests()) == before
            left = [v for v in leftovers(unreserved) if "pgc-02" in v]
            assert left == [], left
        finally:
            unreserved.close()
        assert fleet.instance(INSTANCE).primary is not None
        assert fleet.instance(INSTANCE).primary.info.state == "running"  # type: ignore[union-attr]
    finally:
        lv = small.hosts["h0"]
        for volume in lv.storage.volume_names():
            lv.storage.delete_volume(volume)
        pool = lv.conn.storagePoolLookupByName("pgcsmall")
        pool.destroy()
        pool.undefine()
        small.close()
        SandboxFaults(sandbox).run_in_host("h0", ["umount", path], check=False)


def test_failover_policy_promotes_and_rejoins(carve_env: CarveEnv, fleet: Fleet) -> None:
    raw = carve_env.config.model_dump(mode="json")
    raw["recovery"].update(primary="failover", enabled=True)  # the series' timers kept
    hosts_file = IT_STATE / "hosts-failover.yaml"
    hosts_file.write_text(yaml.safe_dump(raw))
    carve_env.restart_server(hosts_file=hosts_file)
    wait_watching(carve_env)
    # libvirtd restarted under the running manager: its event subscription must come back.
    log = IT_STATE / "server.log"
    seen = log.read_text(errors="replace").count("host h0: lifecycle events reconnected")
    SandboxFaults(carve_env.sandbox).restart_libvirtd("h0")
    wait_for(lambda: log.read_text(errors="replace").count("host h0: lifecycle events reconnected") > seen,
             "the manager to resubscribe to h0's events after libvirtd restarted", 60)
    wait_watching(carve_env)
    old_host = fleet.instance(INSTANCE).primary.info.host  # type: ignore[union-attr]
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(50, 120, "writes before the fault")
        killed_at = time.time()
        kill_guest(carve_env, "h0", INSTANCE)
        incident = wait_for(lambda: incidents_for(carve_env, INSTANCE, killed_at), "the fault to be detected", 30)[0]
        print(f"detected after {(incident['detected_at'] - killed_at) * 1000:.0f} ms")
        assert incident["source"] == "event", incident
        recovered = wait_recovered(carve_env, INSTANCE, killed_at, 900)
        print("failover:", recovered["message"])
        assert recovered["action"] == "failover", recovered
        doc = wait_whole(carve_env, 900)
        assert doc["host"] != old_host, doc
        writer.wait_for_acks(50, 300, "writes after the failover")
    check_nothing_lost(fleet, writer)
    # The writer never asked again: the rw string taken before the fault reached the new primary,
    # and the API still gives the same one.
    assert writer.dsn() == rw_endpoint(carve_env)
    inst = fleet.instance(INSTANCE)
    assert inst.primary is not None and inst.primary.name != INSTANCE
    assert sorted(s.info.host for s in inst.standbys) == sorted({"h0", "h1", "h2"} - {inst.primary.info.host})
    # The killed primary's guest rejoined as a standby rather than being replaced by a new guest.
    assert INSTANCE in {s.name for s in inst.standbys}, [s.name for s in inst.standbys]
    carve_env.restart_server()  # back to the default hosts file for whatever runs next
