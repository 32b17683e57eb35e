"""Carving for real, in a 3-host sandbox: scale 0 -> 1 -> 2 -> 1 -> 2 over HTTP (two standbys' first
boots stuck and built again once; the manager killed and every libvirtd restarted while the second
instance is built, under a writer on the first), pinning read back through libvirt, SQL in every
primary, synchronous standbys on other hosts, committed rows on the standby, a full backup under a
writer listed with its recoverable window, the API's aggregate TPS against pgbench's, a scale-down
that cannot catch up and lifts its fence, and scale-down retiring an instance and scale-up
bringing the same database back.
test_connect.py uses the two instances left here, then purges one. Tests run in file order and
share the booted guests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
import yaml
from pgcarve.backup import pgbackrest
from pgcarve.cli.client import ApiClient
from pgcarve.control.fleet import Fleet, Guest
from pgcarve.control.removal import leftovers
from pgcarve.errors import PgcarveError
from pgcarve.postgres.pgbench import run_pgbench, setup_transactions
from pgcarve.postgres.session import CLIENT_DATABASE
from pgcarve.sandbox.faults import SandboxFaults
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.virt.agent import agent_answers, run_in_guest
from pgcarve.virt.domain_xml import mac_for
from pgcarve.virt.host import LibvirtHost

from tests.integration.conftest import IT_STATE, TOKEN, CarveEnv, wait_for, wait_operation
from tests.support.faults import check_nothing_lost, fleet, writer_for

pytestmark = pytest.mark.integration
__all__ = ["fleet"]  # the fixture, imported for the tests below


def fleet_of(env: CarveEnv) -> Fleet:
    return Fleet(env.config, env.paths)


def test_refused_requests_change_nothing(carve_env: CarveEnv) -> None:
    with carve_env.client(token=None) as anon, carve_env.client() as client:
        assert anon.put("/v1/scale", json={"instances": 1}).status_code == 401
        with carve_env.client(token="wrong-token-0123456789") as wrong:
            assert wrong.put("/v1/scale", json={"instances": 1}).status_code == 401
        assert client.put("/v1/scale", json={"instances": -1}).status_code == 422
        assert client.put("/v1/scale", json={"instances": "two"}).status_code == 422
        assert client.put("/v1/scale", json={"instances": 1.5}).status_code == 422
        over = client.put("/v1/scale", json={"instances": 3})
        assert over.status_code == 409
        assert "room for 2 instances" in over.json()["detail"]
        assert client.get("/v1/instances/pgc-99").status_code == 404
        assert client.get("/v1/instances").json() == []
        assert client.get("/v1/operations").json() == []
    assert leftovers(fleet_of(carve_env)) == []


def _streaming_instances(env: CarveEnv, count: int, timeout_s: float = 300) -> list[dict[str, Any]]:
    """The instance documents once `count` instances each have both standbys streaming, one of them
    synchronous."""
    def streaming() -> list[dict[str, Any]] | None:
        with env.client() as client:
            docs: list[dict[str, Any]] = client.get("/v1/instances").json()
        ok = len(docs) == count and all(
            sum(s["state"] == "streaming" for s in d["standbys"]) == 2
            and any(s["sync_state"] == "sync" and s["state"] == "streaming" for s in d["standbys"]) for d in docs
        )
        return docs if ok else None

    return list(wait_for(streaming, f"{count} instance(s) with both standbys streaming, one synchronous", timeout_s))


def _check_layout(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        assert doc["state"] == "running" and doc["host"] == "h0"
        assert doc["dsn"].startswith("postgresql://pgcarve@127.0.0.1:")
        assert len(doc["standbys"]) == 2
        standby_hosts = {s["host"] for s in doc["standbys"]}
        assert standby_hosts == {"h1", "h2"}, "standbys must be on two other hosts"


def _panic_once_up(lv: LibvirtHost, faults: SandboxFaults, guest: str, stop: threading.Event) -> None:
    """Panic `guest`'s kernel as soon as its system is up (its agent answers), once."""
    while not stop.wait(1):
        with contextlib.suppress(PgcarveError):
            if lv.guest(guest).state == "running" and agent_answers(lv, guest):
                faults.panic_guest(lv.name, guest)
                return


def test_scale_up_to_one_over_http_with_two_first_boots_stuck(carve_env: CarveEnv, fleet: Fleet) -> None:
    """pgc-01's first boots go wrong twice: pgc-01-s1 gets no DHCP answer (its host drops its
    requests) and pgc-01-s2's kernel panics once its system is up. The operation says where each
    stopped and why, keeps their consoles, builds each once more, and succeeds."""
    faults = SandboxFaults(carve_env.sandbox)
    no_dhcp = mac_for("pgc", "pgc-01-s1")
    faults.drop_dhcp("h1", no_dhcp)
    stop = threading.Event()
    panicker = threading.Thread(target=_panic_once_up, args=(fleet.hosts["h2"], faults, "pgc-01-s2", stop))
    panicker.start()
    try:
        with carve_env.client() as client:
            resp = client.put("/v1/scale", json={"instances": 1})
            assert resp.status_code == 202, resp.text
            op_id = resp.json()["operation"]

            def stuck_for_dhcp() -> bool:
                steps = client.get(f"/v1/operations/{op_id}").json()["steps"]
                return bool(steps.get("pgc-01-s1", {}).get("stuck"))

            wait_for(stuck_for_dhcp, "pgc-01-s1 found stuck without an address", 900)
            faults.answer_dhcp("h1", no_dhcp)  # its second boot gets its address
        op = wait_operation(carve_env, op_id)
        assert op["status"] == "succeeded", op["error"]
    finally:
        stop.set()
        faults.answer_dhcp("h1", no_dhcp)
        panicker.join(timeout=30)
    steps = cast(dict[str, Any], op["steps"])
    (dhcp,) = steps["pgc-01-s1"]["stuck"]
    assert "boot stopped at stage 'address'" in dhcp and "it got no address (no DHCP lease)" in dhcp, dhcp
    (panic,) = steps["pgc-01-s2"]["stuck"]
    assert "its kernel panicked" in panic and "Kernel panic - not syncing" in panic, panic
    for diagnosis in (dhcp, panic):
        kept = Path(diagnosis.split("its console is kept in ", 1)[1].split()[0])
        assert kept.is_file() and kept.is_relative_to(carve_env.paths.state_dir / "consoles"), diagnosis
    print("pgc-01-s1:", dhcp, "\npgc-01-s2:", panic)
    docs = _streaming_instances(carve_env, 1)
    assert [d["name"] for d in docs] == ["pgc-01"]
    _check_layout(docs)


def test_scale_to_two_with_the_manager_killed_mid_build_and_libvirtd_restarted(carve_env: CarveEnv,
                                                                               fleet: Fleet) -> None:
    """pgc-01's writer runs while pgc-02 is built. The manager dies (failpoint: as kill -9 would)
    once pgc-02's first standby replays; a client then commits a row there (the instance can
    acknowledge commits, though it was not offered yet). Every libvirtd restarts, then the
    manager: it keeps pgc-02 (never discards an instance that may hold an acknowledged commit),
    removes only standbys still being built, and finishes the operation; pgc-01's writer loses
    nothing, no CPU is given twice, no disk is orphaned. pgc-02 is built once in the whole suite:
    the tests after this one use it."""
    log_file = IT_STATE / "server.log"  # appended to by every server start: read only what follows
    log_start = log_file.stat().st_size
    failpoints = IT_STATE / "failpoints"
    failpoints.mkdir(exist_ok=True)
    for marker in failpoints.glob("*"):
        marker.unlink()
    carve_env.restart_server(extra_env={"PGCARVE_FAILPOINTS": "provisioning.standby_replaying",
                                        "PGCARVE_FAILPOINT_DIR": str(failpoints)})
    with writer_for(carve_env, fleet) as writer:
        writer.wait_for_acks(20, 120, "writes before the fault")
        with carve_env.client() as client:
            resp = client.put("/v1/scale", json={"instances": 2})
            assert resp.status_code == 202, resp.text
            op_id = resp.json()["operation"]

        def offered_too_early() -> bool:
            """Until the manager stops: pgc-02 is never offered (no DSN) while being built."""
            if carve_env.server.poll() is not None:
                return True
            try:
                with carve_env.client() as client:
                    docs = client.get("/v1/instances").json()
            except Exception:
                return False
            for doc in docs:
                if doc["name"] == "pgc-02":
                    assert doc["dsn"] is None and doc["state"] == "creating", doc
            return False

        wait_for(offered_too_early, "the manager to stop at its failpoint while building pgc-02", 1200)
        assert carve_env.server.wait(30) == 137
        half = {g.name: g.creating for g in fleet.guests() if g.metadata.index == 2}
        print("left by the killed manager (name: still marked creating):", half)
        assert half.get("pgc-02") is False, "the primary loses its mark before any standby can clone from it"
        primary = fleet.instance("pgc-02").primary
        assert primary is not None
        with fleet.connect(primary, database=CLIENT_DATABASE) as conn:
            conn.execute("create table taken(note text)")
            conn.execute("insert into taken values ('acknowledged while pgc-02 was being created')")
        for index in range(3):
            SandboxFaults(carve_env.sandbox).restart_libvirtd(f"h{index}")
        carve_env.restart_server()
        op = wait_operation(carve_env, op_id, 1200)
        assert op["status"] == "succeeded", op
        with log_file.open("rb") as f:
            f.seek(log_start)
            log = f.read().decode(errors="replace")
        assert "half-made instance pgc-02" not in log, "pgc-02 may hold an acknowledged commit: never discarded"
        assert "instance pgc-01 (" not in log, "the whole instance pgc-01 was taken for half-made"
        # pgc-02's standbys removed half-built are built again by the HA loop, one synchronous.
        docs = _streaming_instances(carve_env, 2, 1200)
        writer.wait_for_acks(20, 300, "writes after the manager and libvirtd restarts")
    assert [d["name"] for d in docs] == ["pgc-01", "pgc-02"]
    _check_layout(docs)

    def taken_rows() -> tuple[object, ...] | None:
        primary = fleet.instance("pgc-02").primary
        assert primary is not None
        try:
            with fleet.connect(primary, timeout_s=10, database=CLIENT_DATABASE) as conn:
                return conn.execute("select count(*) from taken").fetchone()
        except psycopg.OperationalError:  # under emulation, a primary its standbys just cloned from answers late
            return None

    assert wait_for(taken_rows, "pgc-02's primary to answer", 300) == (1,)
    instances = fleet.observe()
    assert [i.name for i in instances] == ["pgc-01", "pgc-02"]
    for inst in instances:
        assert inst.primary is not None and len(inst.standbys) == 2
    guests = fleet.guests()
    assert not [g.name for g in guests if g.creating]
    by_host: dict[str, list[int]] = {}
    for g in guests:
        by_host.setdefault(g.host, []).extend(c for row in g.vcpu_pins for c in row)
    for host, cpus in by_host.items():
        assert len(cpus) == len(set(cpus)), f"a CPU of {host} is given twice: {sorted(cpus)}"
    names = {g.name for g in guests}
    volumes = [v for v in leftovers(fleet) if v.startswith("volume ")]
    orphans = [v for v in volumes
               if v.split()[1].removesuffix(".qcow2").removesuffix("-seed.iso") not in names]
    assert orphans == [], orphans
    check_nothing_lost(fleet, writer)


def test_pinning_read_back_from_libvirt_is_disjoint(carve_env: CarveEnv) -> None:
    fleet = fleet_of(carve_env)
    for host_cfg in carve_env.config.hosts:
        lv = LibvirtHost(host_cfg.name, host_cfg.uri)
        guests = lv.guests("pgc")
        assert len(guests) == 2, f"{host_cfg.name} should run 2 guests"
        seen: set[int] = set()
        for guest in guests:
            cpus = {c for row in guest.vcpu_pins for c in row}
            assert cpus, f"{guest.name} is not pinned"
            assert not cpus & seen, f"{guest.name} shares host CPUs {cpus & seen} with another guest"
            seen |= cpus
            _plan, slot = fleet.placement.slot(host_cfg.name, guest.metadata.index)
            assert tuple(sorted(cpus)) == tuple(sorted(slot.host_cpus))
        lv.close()


def test_sql_in_each_primary_and_rows_on_standbys(carve_env: CarveEnv) -> None:
    fleet = fleet_of(carve_env)
    for inst in fleet.observe():
        assert inst.primary is not None
        with fleet.connect(inst.primary, database=CLIENT_DATABASE) as conn:
            conn.execute("create table if not exists acked(id int primary key, note text)")
            for i in range(50):
                conn.execute("insert into acked values (%s, %s)", (i, inst.name))  # each commit acknowledged
            assert conn.execute("select count(*) from acked").fetchone() == (50,)
            assert conn.execute("show synchronous_commit").fetchone() == ("remote_write",)
        for standby in inst.standbys:
            assert standby.info.host != inst.primary.info.host

            def replayed(s: Guest = standby) -> bool:
                try:
                    with fleet.connect(s, database=CLIENT_DATABASE) as sconn:
                        row = sconn.execute("select count(*) from acked").fetchone()
                        return row == (50,)
                except psycopg.errors.UndefinedTable:
                    return False

            wait_for(replayed, f"50 rows replayed on {standby.name}", 60)
    fleet.close()


def test_a_full_backup_under_writes_is_listed_with_its_recoverable_window(carve_env: CarveEnv) -> None:
    """pgc-01 archives its WAL to the sandbox's repository host (SFTP) from its first boot; under a
    writer, a full backup by the API proves archiving first (the tool's check: a WAL switch waited
    for in the repository), is listed with its type, times, size and WAL range, and the window it
    opens starts at its end. Bad requests are refused before anything runs."""
    fleet = fleet_of(carve_env)
    with carve_env.client() as client:
        assert client.post("/v1/instances/pgc-01/backups", json={"type": "weekly"}).status_code == 422
        assert client.post("/v1/instances/pgc-09/backups", json={"type": "full"}).status_code == 404
        with writer_for(carve_env, fleet) as writer:
            writer.wait_for_acks(20, 120, "commits before the backup")
            asked = time.time()
            resp = client.post("/v1/instances/pgc-01/backups", json={"type": "full"})
            assert resp.status_code == 202, resp.text
            op = wait_operation(carve_env, resp.json()["operation"], 900)
            assert op["status"] == "succeeded", op
            writer.wait_for_acks(20, 120, "commits after the backup")
        check_nothing_lost(fleet, writer)
        result = op["result"]
        assert isinstance(result, dict)
        print(f"backup: {op['message']}; operation took {time.time() - asked:.1f} s")
        listing = client.get("/v1/instances/pgc-01/backups")
        assert listing.status_code == 200, listing.text
        doc = listing.json()
    assert doc["status"] == "ok"
    backup = next(b for b in doc["backups"] if b["label"] == result["label"])
    assert backup["type"] == "full" and backup["size_bytes"] > 10 * 2**20 and not backup["error"]
    assert asked - 5 <= backup["started_at"] <= backup["stopped_at"] <= time.time() + 5
    assert backup["wal_start"] <= backup["wal_stop"]
    window = doc["window"]
    assert window["earliest"] <= backup["stopped_at"] <= window["latest_proven"]
    assert window["wal_last"] >= backup["wal_stop"], "the WAL the backup needs is in the archive"
    # The tool's own words, kept for the unit tests' recorded sample (tests/data/pgbackrest/).
    inst = fleet.instance("pgc-01")
    assert inst.primary is not None
    raw = fleet.hosts[inst.primary.info.host]
    info = run_in_guest(raw, inst.primary.name, pgbackrest.info("pgc-01"), 120, user="postgres")
    out = Path(__file__).resolve().parents[1] / "output" / "pgbackrest-info-pgc-01.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(info.stdout)
    assert pgbackrest.parse_info(info.stdout, "pgc-01").backups[-1].label == result["label"]
    fleet.close()


def test_cli_status_shows_pinned_guests(carve_env: CarveEnv) -> None:
    env = {"PGCARVE_STATE_DIR": str(carve_env.paths.state_dir)}
    proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", "status", "--json", "--local"],
                          capture_output=True, text=True, env=dict(os.environ, **env), check=True)
    rows = json.loads(proc.stdout)
    assert {r["name"] for r in rows} == {"pgc-01", "pgc-02", "pgc-01-s1", "pgc-01-s2", "pgc-02-s1", "pgc-02-s2"}
    assert all(r["state"] == "running" and r["host_cpus"] and r["dsn"] for r in rows)


def test_api_aggregate_tps_matches_pgbench(carve_env: CarveEnv) -> None:
    """pgbench's own TPS against the API's count over the same window, counted as `pgcarve load`
    (make demo) counts it: from a moment the API has every primary's baseline, to the first
    sample in which every primary was polled 3 s after pgbench finished. Per-second figures are
    not compared: PostgreSQL publishes commit counts up to ~1 s late, which moves single seconds
    from one sample to the next but not in or out of a window that ends idle."""
    fleet = fleet_of(carve_env)
    instances = [inst for inst in fleet.observe() if inst.primary]
    primaries = [inst.primary for inst in instances if inst.primary]
    names = [inst.name for inst in instances]  # the API counts by instance, not by guest
    seconds, clients = 30, 4
    api = ApiClient(carve_env.url, TOKEN)
    # A sample of every primary taken after the last writes of the tests before (published up to
    # ~1 s late), so none of them is counted with the load.
    assert api.wait_until_sampled(names, wait_s=120, since=time.time() + 1) == [], \
        "the collector has no fresh sample of every primary"
    window_start = time.time()  # before run_pgbench's CREATE TABLE, which the set-up count includes
    results = []

    def load(guest: Guest) -> None:
        results.append(run_pgbench(guest.name, guest.endpoint, fleet.credentials.admin_password, clients, 2,
                                   seconds, tls=fleet.client_tls))

    threads = [threading.Thread(target=load, args=(g,)) for g in primaries]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(primaries) and all(r.failed == 0 for r in results)
    api_transactions = api.transactions_during(window_start, max(r.finished_at for r in results),
                                               wait_s=120, instances=tuple(names))
    assert api_transactions is not None, "no API sample in which every primary was polled after the load"
    metrics = api.get_text("/metrics")
    assert "pgcarve_xact_total{" in metrics and "pgcarve_instance_pinned_cpu{" in metrics
    # The API counts every client transaction, pgbench only its own: per run, run_pgbench's
    # CREATE TABLE session, pgbench's main session, and per client a start-up and its PREPARE.
    # Background work is not in the client count (autovacuum, the manager's own sessions).
    overhead = sum(setup_transactions(clients) for _ in results)
    pgbench_transactions = sum(r.transactions for r in results)
    pgbench_tps = pgbench_transactions / seconds
    api_tps = (api_transactions - overhead) / seconds
    print(f"{len(results)} pgbench runs of {seconds} s: pgbench {pgbench_transactions} transactions "
          f"({pgbench_tps:.2f} TPS), API {api_transactions} client transactions less {overhead} set-up "
          f"({api_tps:.2f} TPS, {(api_tps - pgbench_tps) / pgbench_tps * 100:+.2f}%)")
    assert abs(api_tps - pgbench_tps) / pgbench_tps <= 0.03
    fleet.close()


def test_waits_show_commits_waiting_for_their_standby(carve_env: CarveEnv) -> None:
    """GET /v1/instances/{name}/waits while the experiment's insert load runs: the live sampler,
    started by the first request, sees the client sessions, and commits waiting for the
    synchronous standby among them."""
    fleet = fleet_of(carve_env)
    primary = fleet.instance("pgc-01").primary
    assert primary is not None
    with carve_env.client() as client:  # nobody asked yet: not sampled; asking starts it
        first = client.get("/v1/instances/pgc-01/waits").json()
    assert first["samples"] == 0 and first["error"].startswith("not sampled yet"), first

    def sampling() -> bool:
        with carve_env.client() as client:
            doc = client.get("/v1/instances/pgc-01/waits").json()
        return bool(doc["samples"] > 0 and doc["error"] is None)

    wait_for(sampling, "the sampler to start on pgc-01", 120)  # so that it samples the whole load
    run_pgbench(primary.name, primary.endpoint, fleet.credentials.admin_password, 4, 2, 8, tls=fleet.client_tls)
    with carve_env.client() as client:
        waits = client.get("/v1/instances/pgc-01/waits").json()
        assert client.get("/v1/instances/pgc-99/waits").status_code == 404
    print(f"pgc-01 waits: {waits['summary']}; shares {waits['shares']}")
    assert waits["error"] is None and waits["samples"] > 0 and waits["sessions"] > 0
    assert waits["shares"]["SyncRep"] > 0, "no sampled commit waited for the synchronous standby"
    fleet.close()


def _scale(env: CarveEnv, instances: int, timeout_s: float = 1500) -> dict[str, Any]:
    with env.client() as client:
        resp = client.put("/v1/scale", json={"instances": instances})
        assert resp.status_code == 202, resp.text
    return wait_operation(env, resp.json()["operation"], timeout_s)


def _instance_doc(env: CarveEnv, name: str) -> dict[str, Any]:
    with env.client() as client:
        resp = client.get(f"/v1/instances/{name}")
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


def test_a_scale_down_that_cannot_catch_up_lifts_its_fence(carve_env: CarveEnv) -> None:
    """pgc-02's standbys stop replaying (pg_wal_replay_pause): retiring it fences its writes, the
    API says so, then gives up after retire_catch_up_s and the primary accepts writes again."""
    raw = carve_env.config.model_dump(mode="json")
    raw["replication"]["retire_catch_up_s"] = 20
    hosts_file = IT_STATE / "hosts-catch-up.yaml"
    hosts_file.write_text(yaml.safe_dump(raw))
    carve_env.restart_server(hosts_file=hosts_file)
    fleet = fleet_of(carve_env)
    inst = fleet.instance("pgc-02")
    assert inst.primary is not None
    try:
        for standby in inst.standbys:
            with fleet.connect(standby) as conn:
                conn.execute("select pg_wal_replay_pause()")
        with fleet.connect(inst.primary, database=CLIENT_DATABASE) as conn:
            conn.execute("insert into acked values (2000, 'not replayed yet')")  # acknowledged (written)
        with carve_env.client() as client:
            resp = client.put("/v1/scale", json={"instances": 1})
            assert resp.status_code == 202, resp.text
        fenced = wait_for(lambda: _instance_doc(carve_env, "pgc-02")["writes"].startswith("refused: new writes are "
                                                                                          "fenced (scale-down"),
                          "the API to report pgc-02's write fence", 60)
        print("while fenced:", _instance_doc(carve_env, "pgc-02")["writes"], fenced)
        op = wait_operation(carve_env, resp.json()["operation"], 300)
        assert op["status"] == "failed" and "accepts writes again" in str(op["error"]), op
        with fleet.connect(inst.primary, database=CLIENT_DATABASE) as conn:
            assert conn.execute("show default_transaction_read_only").fetchone() == ("off",)
            conn.execute("insert into acked values (2001, 'after the failed scale-down')")
    finally:
        for standby in inst.standbys:
            with fleet.connect(standby) as conn:
                conn.execute("select pg_wal_replay_resume()")
        fleet.close()
    wait_for(lambda: _instance_doc(carve_env, "pgc-02")["writes"] == "accepted", "pgc-02 to accept writes", 60)
    carve_env.restart_server()


def test_scale_down_retires_and_scale_up_brings_the_database_back(carve_env: CarveEnv) -> None:
    fleet = fleet_of(carve_env)
    before = {}
    for name in ("pgc-01", "pgc-02"):
        primary = fleet.instance(name).primary
        assert primary is not None
        with fleet.connect(primary, database=CLIENT_DATABASE) as conn:
            conn.execute("insert into acked values (1000, 'before scale-down')")
            before[name] = conn.execute("select system_identifier, (select count(*) from acked) "
                                        "from pg_control_system()").fetchone()
    forwards = ForwardRegistry(carve_env.paths.sandbox_dir / "forwards")
    ports_before = {g: p for g, p in forwards.ports().items() if g.startswith("pgc-02")}
    assert len(ports_before) == 3, ports_before
    op = _scale(carve_env, 1, 300)
    assert op["status"] == "succeeded", op["error"]
    assert "retired 1 (disks kept)" in str(op["message"]), op
    with carve_env.client() as client:
        assert [d["name"] for d in client.get("/v1/instances").json()] == ["pgc-01"]
        docs = client.get("/v1/instances", params={"include": "retired"}).json()
    retired = next(d for d in docs if d["name"] == "pgc-02")
    assert retired["state"] == "retired" and retired["dsn"] is None and retired["disk_mib"] > 0
    assert sorted(s["host"] for s in retired["standbys"]) == ["h1", "h2"]
    assert [g.name for g in fleet.guests() if g.metadata.index == 2] == [], "its CPUs are free"
    kept = [v for v in leftovers(fleet) if v.startswith("volume pgc-02")]
    assert len(kept) >= 6, f"pgc-02's disks and seeds must be kept: {kept}"
    primary = fleet.instance("pgc-01").primary
    assert primary is not None
    with fleet.connect(primary, database=CLIENT_DATABASE) as conn:
        conn.execute("insert into acked values (1001, 'after scale-down')")  # still writable, sync

    op = _scale(carve_env, 2)
    assert op["status"] == "succeeded", op["error"]
    assert "brought back 1 from retirement" in str(op["message"]), op
    doc = wait_for(lambda: (d := _instance_doc(carve_env, "pgc-02"))["writes"] == "accepted"
                   and sum(s["state"] == "streaming" for s in d["standbys"]) == 2 and d,
                   "pgc-02 back with both standbys streaming", 300)
    assert doc["dsn"] and doc["host"] == "h0"
    primary = fleet.instance("pgc-02").primary
    assert primary is not None
    with fleet.connect(primary, database=CLIENT_DATABASE) as conn:
        after = conn.execute("select system_identifier, (select count(*) from acked) from pg_control_system()")
        assert after.fetchone() == before["pgc-02"], "the same database, every row"
        conn.execute("insert into acked values (1002, 'after coming back')")
    fleet.close()
    # Its endpoints are the ones applications already have: every guest kept its forward port.
    assert {g: forwards.port(g) for g in ports_before} == ports_before
