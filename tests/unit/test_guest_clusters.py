"""images/rootfs/usr/local/sbin/pgcarve-clusters, the guest's hook for several PostgreSQL clusters
(the benchmark's multi-instance case), run as a module against a temporary directory: what it
reads from the seed, the configuration it writes, and the commands it would run (pg_createcluster,
pg_ctlcluster, pg_basebackup, psql), recorded by a stand-in. Nothing here writes to this machine's
/etc or /var or runs a command; creating, cloning and starting real clusters happens in a booted
guest (python -m bench --cases multi-instance)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import stat
import subprocess
from pathlib import Path, PurePath
from types import ModuleType
from typing import Any

import pytest
from pgcarve.config import InstanceSize
from pgcarve.errors import ConfigError

from tests.support.seeds import guest_seed

ROOTFS = Path(__file__).resolve().parents[2] / "images" / "rootfs"
SCRIPT = ROOTFS / "usr" / "local" / "sbin" / "pgcarve-clusters"
VERIFIER = "SCRAM-SHA-256$4096:c2FsdA==$c3RvcmVk:c2VydmVy"
MEMORY = "\n".join(["# Written at boot by pgcarve-guest-setup", "shared_buffers = 192MB", "wal_buffers = 6MB",
                    "effective_cache_size = 460MB", "maintenance_work_mem = 48MB", "max_wal_size = 384MB",
                    "checkpoint_timeout = 15min", ""])
PATH_CONSTANTS = ("SEED", "MAJOR_FILE", "ETC_DIR", "DATA_ROOT", "BIN_DIR", "STATE_DIR", "TLS_CA")


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("pgcarve_clusters", str(SCRIPT))
    spec = importlib.util.spec_from_loader("pgcarve_clusters", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def refuse(args: list[str], **_kwargs: Any) -> subprocess.CompletedProcess[str]:
    raise AssertionError(f"this test runs no command, yet the script ran {args}")


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script with every path under tmp_path/guest, files owned by whoever runs the test, no
    pause between retries and no command allowed (tests that expect commands install a Guest)."""
    module = load_script()
    root = tmp_path / "guest"
    monkeypatch.setattr(module, "SEED", root / "etc" / "pgcarve" / "instance.json")
    monkeypatch.setattr(module, "VERSION", "17")  # what the image's postgresql-major file would say
    monkeypatch.setattr(module, "ETC_DIR", root / "etc" / "postgresql" / "17")
    monkeypatch.setattr(module, "DATA_ROOT", root / "var" / "lib" / "postgresql" / "17")
    monkeypatch.setattr(module, "BIN_DIR", root / "usr" / "lib" / "postgresql" / "17" / "bin")
    monkeypatch.setattr(module, "STATE_DIR", root / "var" / "lib" / "pgcarve")
    monkeypatch.setattr(module, "MAJOR_FILE", root / "usr" / "share" / "pgcarve" / "postgresql-major")
    monkeypatch.setattr(module, "TLS_CA", root / "etc" / "pgcarve" / "tls" / "ca.pem")
    monkeypatch.setattr(module, "postgres_ids", lambda: (os.getuid(), os.getgid()))
    monkeypatch.setattr(module, "pause", lambda: None)
    monkeypatch.setattr(module, "run", refuse)
    # Every path constant of the script is one of the above: a new one must be added here.
    paths = {name for name, value in vars(module).items() if isinstance(value, PurePath)}
    assert paths == set(PATH_CONSTANTS)
    for name in PATH_CONSTANTS:
        assert getattr(module, name).is_relative_to(tmp_path)
    module.SEED.parent.mkdir(parents=True)
    (module.ETC_DIR / "main" / "conf.d").mkdir(parents=True)
    (module.ETC_DIR / "main" / "conf.d" / "55-pgcarve-memory.conf").write_text(MEMORY)
    (module.DATA_ROOT / "main").mkdir(parents=True)
    module.STATE_DIR.mkdir(parents=True)
    return module


class Guest:
    """Stands in for the guest's commands: Debian's cluster tools, runuser + pg_basebackup/psql."""

    def __init__(self, script: ModuleType, basebackup_errors: tuple[str, ...] = ()):
        self.script = script
        self.commands: list[list[str]] = []
        self.running = {"main"}
        self.basebackup_errors = list(basebackup_errors)
        self.sql: dict[int, str] = {}  # port -> what psql was given

    def __call__(self, args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        self.commands.append(list(args))
        if args[0] == "pg_createcluster":
            port, name = args[args.index("--port") + 1], args[-1]
            conf = self.script.ETC_DIR / name
            (conf / "conf.d").mkdir(parents=True)
            (conf / "postgresql.conf").write_text(f"port = {port}\ninclude_dir = 'conf.d'\n")
            (self.script.DATA_ROOT / name).mkdir(parents=True)
            (self.script.DATA_ROOT / name / "PG_VERSION").write_text("17\n")
            return subprocess.CompletedProcess(args, 0)
        if args[0] == "pg_ctlcluster":
            _version, name, action = args[1:]
            if action == "status":
                return subprocess.CompletedProcess(args, 0 if name in self.running else 3)
            assert action != "start" or (self.script.DATA_ROOT / name / "PG_VERSION").exists()
            if action in ("start", "stop"):
                (self.running.add if action == "start" else self.running.discard)(name)
            return subprocess.CompletedProcess(args, 0)
        assert args[:4] == ["runuser", "-u", "postgres", "--"], args
        tool = args[4]
        if tool.endswith("/pg_basebackup"):
            if self.basebackup_errors:
                return subprocess.CompletedProcess(args, 1, "", self.basebackup_errors.pop(0))
            datadir = Path(args[args.index("-D") + 1])
            datadir.mkdir()
            (datadir / "PG_VERSION").write_text("17\n")
            return subprocess.CompletedProcess(args, 0, "", "")
        assert tool == "psql", args
        self.sql[int(args[args.index("-p") + 1])] = kwargs["input"].decode()
        return subprocess.CompletedProcess(args, 0)

    def named(self, tool: str) -> list[list[str]]:
        return [c for c in self.commands if c[0] == tool or (c[0] == "runuser" and c[4].endswith(tool))]


def seed(**fields: object) -> dict[str, object]:
    return {"name": "pgcbm0a1b-01", "role": "primary", "admin_password_scram": VERIFIER,
            "replication_password_scram": VERIFIER, **fields}


def standby_seed(**fields: object) -> dict[str, object]:
    return seed(role="standby", name="pgcbm0a1b-01-s1", primary_host="10.77.0.12", replication_password="a" * 20,
                slot_name="pgcbm0a1b_01_s1", **fields)


def write_seed(script: ModuleType, doc: dict[str, object]) -> None:
    script.SEED.write_text(json.dumps(doc))


def boot(script: ModuleType, guest: Guest) -> None:
    """What one boot runs: before-start (as pgcarve-guest-setup's ExecStartPost), then after-start."""
    setattr(script, "run", guest)  # the script's one way to run commands, replaced
    assert script.main(["pgcarve-clusters", "before-start"]) == 0
    assert script.main(["pgcarve-clusters", "after-start"]) == 0


# -- the seed -------------------------------------------------------------------------------


def test_one_cluster_means_nothing_to_do(script: ModuleType) -> None:
    assert script.load_seed() is None  # no seed at all
    write_seed(script, seed())
    assert script.load_seed() is None
    assert script.main(["pgcarve-clusters", "before-start"]) == 0
    assert script.main(["pgcarve-clusters", "after-start"]) == 0  # and runs nothing (run refuses)
    write_seed(script, seed(clusters=3))
    assert script.load_seed()["clusters"] == 3


@pytest.mark.parametrize("fields", [{"clusters": 0}, {"clusters": 17}, {"clusters": "2"}, {"clusters": True},
                                    {"clusters": 2, "role": "witness"},
                                    {"clusters": 2, "admin_password_scram": "md5abc"},
                                    {"clusters": 2, "name": "Bad Name"}])
def test_bad_seeds_are_refused(script: ModuleType, fields: dict[str, object]) -> None:
    write_seed(script, seed(**fields))
    with pytest.raises(SystemExit):
        script.load_seed()


@pytest.mark.parametrize("fields", [{"primary_host": "10.0.0.1; rm -rf /"}, {"replication_password": "short"},
                                    {"slot_name": "Slot-1"}, {"primary_host": ""}])
def test_bad_standby_seeds_are_refused(script: ModuleType, fields: dict[str, object]) -> None:
    write_seed(script, {**standby_seed(clusters=2), **fields})
    with pytest.raises(SystemExit):
        script.load_seed()


@pytest.mark.parametrize("role", ["primary", "standby"])
def test_the_managers_seed_is_what_the_script_reads(script: ModuleType, role: str) -> None:
    name = "pgcbm0a1b-01" + ("-s1" if role == "standby" else "")
    one = guest_seed(name, role, ("10.77.0.0/16",))
    assert "clusters" not in one.instance_json()  # ordinary guests' seeds do not change
    write_seed(script, {**one.instance_json(), "clusters": 1})
    assert script.load_seed() is None
    three = guest_seed(name, role, ("10.77.0.0/16",), clusters=3)
    write_seed(script, three.instance_json())
    loaded = script.load_seed()
    assert loaded is not None and loaded["clusters"] == 3 and loaded["role"] == role


@pytest.mark.parametrize("count", [0, 17])
def test_the_manager_refuses_what_the_script_would(count: int) -> None:
    with pytest.raises(ConfigError, match=r"clusters must be 1\.\.16"):
        guest_seed("pgc-01", "primary", clusters=count)
    with pytest.raises(ValueError, match="clusters"):
        InstanceSize(clusters=count)


def test_ports_and_names(script: ModuleType) -> None:
    assert [(script.cluster(k), script.port(k)) for k in (1, 2, 3)] == [("main", 5432), ("c2", 5433), ("c3", 5434)]


# -- memory -------------------------------------------------------------------------------


def test_memory_is_divided_between_the_clusters(script: ModuleType) -> None:
    lines = script.split_memory(MEMORY, 4).splitlines()
    assert lines[1:] == ["shared_buffers = 48MB", "wal_buffers = 1MB", "effective_cache_size = 115MB",
                         "maintenance_work_mem = 16MB"]  # WAL sizes stay: they are disk, not memory
    assert "shared_buffers = 16MB" in script.split_memory("shared_buffers = 32MB", 16)


def test_before_start_gives_main_its_share_and_takes_it_back(script: ModuleType) -> None:
    share = script.ETC_DIR / "main" / "conf.d" / "58-pgcarve-clusters.conf"
    write_seed(script, seed(clusters=2))
    assert script.main(["pgcarve-clusters", "before-start"]) == 0
    assert "shared_buffers = 96MB" in share.read_text()
    assert stat.S_IMODE(share.stat().st_mode) == 0o644
    assert sorted(p.name for p in share.parent.iterdir()) == ["55-pgcarve-memory.conf", "58-pgcarve-clusters.conf"]
    write_seed(script, seed())  # the same guest, booted again with one cluster
    assert script.main(["pgcarve-clusters", "before-start"]) == 0
    assert not share.exists()


def test_before_start_needs_guest_setups_memory_settings(script: ModuleType) -> None:
    (script.ETC_DIR / "main" / "conf.d" / "55-pgcarve-memory.conf").unlink()
    write_seed(script, seed(clusters=2))
    with pytest.raises(SystemExit, match=r"55-pgcarve-memory\.conf"):
        script.before_start()


# -- a primary ------------------------------------------------------------------------------


def test_a_primary_makes_configures_starts_and_seeds_each_cluster(script: ModuleType) -> None:
    write_seed(script, seed(clusters=3))
    guest = Guest(script)
    boot(script, guest)
    assert guest.named("pg_createcluster") == [
        ["pg_createcluster", "--port", str(port), "--start-conf", "auto", "--encoding", "UTF8", "--locale", "C.UTF-8",
         "17", name] for port, name in ((5433, "c2"), (5434, "c3"))]
    assert guest.running == {"main", "c2", "c3"}
    main_conf = script.ETC_DIR / "main"
    for k, name in ((2, "c2"), (3, "c3")):
        conf_d = script.ETC_DIR / name / "conf.d"
        assert sorted(p.name for p in conf_d.iterdir()) == ["00-pgcarve-main.conf", "90-pgcarve-cluster.conf"]
        assert f"include_dir = '{main_conf / 'conf.d'}'" in (conf_d / "00-pgcarve-main.conf").read_text()
        own = (conf_d / "90-pgcarve-cluster.conf").read_text().splitlines()
        assert f"port = {5431 + k}" in own
        assert f"hba_file = '{main_conf / 'pg_hba.conf'}'" in own
        assert f"ident_file = '{main_conf / 'pg_ident.conf'}'" in own
        assert (script.STATE_DIR / f"cluster-{name}-ready").exists()
    assert sorted(guest.sql) == [5433, 5434]
    sql = guest.sql[5433]
    assert sql.startswith("SET synchronous_commit = local;")  # its standby is not there yet
    assert f"ALTER ROLE pgcarve PASSWORD '{VERIFIER}';" in sql
    assert f"ALTER ROLE replicator PASSWORD '{VERIFIER}';" in sql
    assert "CREATE DATABASE pgcarve OWNER pgcarve" in sql and "pg_stat_statements" in sql
    assert not guest.named("pg_basebackup")
    # main's share of memory, as pgcarve-guest-setup's ExecStartPost wrote it
    assert "shared_buffers = 64MB" in (main_conf / "conf.d" / "58-pgcarve-clusters.conf").read_text()


def test_a_primary_rebooted_keeps_its_clusters_and_roles(script: ModuleType) -> None:
    write_seed(script, seed(clusters=2))
    boot(script, Guest(script))
    again = Guest(script)  # after a reboot: Debian starts c2 itself (start.conf auto)
    again.running.add("c2")
    boot(script, again)
    assert [c[0] for c in again.commands] == ["pg_ctlcluster"]  # status only
    stopped = Guest(script)  # or c2 failed to start at boot
    boot(script, stopped)
    assert [c[-1] for c in stopped.named("pg_ctlcluster")] == ["status", "start"]
    assert not stopped.sql and not stopped.named("pg_createcluster")


# -- a standby ------------------------------------------------------------------------------


def test_a_standby_clones_each_cluster_from_the_same_port_of_its_primary(script: ModuleType) -> None:
    write_seed(script, standby_seed(clusters=2))
    guest = Guest(script, basebackup_errors=(
        "pg_basebackup: error: connection to server at \"10.77.0.12\", port 5433 failed: Connection refused",
        "pg_basebackup: error: could not send replication command \"CREATE_REPLICATION_SLOT\": "
        "ERROR:  replication slot \"pgcbm0a1b_01_s1\" already exists",
    ))
    boot(script, guest)
    backups = guest.named("pg_basebackup")
    assert len(backups) == 3
    conninfo = ("host=10.77.0.12 port=5433 user=replicator application_name=pgcbm0a1b_01_s1 "
                f"sslmode=verify-ca sslrootcert={script.TLS_CA}")
    datadir = script.DATA_ROOT / "c2"
    for backup in backups:
        assert backup[5:9] == ["-d", conninfo, "-D", str(datadir)]
        assert backup[backup.index("-S") + 1] == "pgcbm0a1b_01_s1"
    assert [("-C" in b) for b in backups] == [True, True, False]  # the slot, once made, is reused
    assert (datadir / "standby.signal").exists()
    assert guest.running == {"main", "c2"}
    # stopped before the clone (pg_createcluster's own data directory is replaced), started after
    assert [c[-1] for c in guest.named("pg_ctlcluster")] == ["status", "status", "start"]
    standby_conf = script.ETC_DIR / "c2" / "conf.d" / "95-pgcarve-standby.conf"
    assert stat.S_IMODE(standby_conf.stat().st_mode) == 0o600  # it holds the replication password
    assert standby_conf.read_text() == (f"primary_conninfo = '{conninfo} password={'a' * 20}'\n"
                                        "primary_slot_name = 'pgcbm0a1b_01_s1'\n")
    assert not guest.sql  # a standby's roles come from its primary
    assert (script.STATE_DIR / "cluster-c2-ready").exists()


def test_a_standby_is_cloned_only_once(script: ModuleType) -> None:
    write_seed(script, standby_seed(clusters=2))
    boot(script, Guest(script))
    again = Guest(script)
    boot(script, again)
    assert not again.named("pg_basebackup")
    assert again.running == {"main", "c2"}


def test_a_standby_whose_primary_never_answers_gives_up(script: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    write_seed(script, standby_seed(clusters=2))
    monkeypatch.setattr(script, "CLONE_DEADLINE_S", -1)
    guest = Guest(script, basebackup_errors=("pg_basebackup: error: connection refused",))
    monkeypatch.setattr(script, "run", guest)
    with pytest.raises(SystemExit, match=r"c2: could not clone from 10\.77\.0\.12:5433"):
        script.after_start()
    assert not (script.DATA_ROOT / "c2").exists()
    assert not (script.STATE_DIR / "cluster-c2-ready").exists()


def test_a_standby_cluster_follows_the_primary_cluster_on_its_port(script: ModuleType) -> None:
    ca = script.TLS_CA
    assert script.standby_conninfo(standby_seed(), 3) == ("host=10.77.0.12 port=5434 user=replicator "
                                                          "application_name=pgcbm0a1b_01_s1 "
                                                          f"sslmode=verify-ca sslrootcert={ca}")


def test_a_new_pg_hba_reloads_every_further_cluster_that_runs(script: ModuleType) -> None:
    # Clusters 2..N read main's pg_hba.conf; the manager reloads main only when it lets a standby in.
    write_seed(script, seed(clusters=4))
    guest = Guest(script)
    boot(script, guest)
    guest.running.discard("c4")
    guest.commands.clear()
    assert script.main(["pgcarve-clusters", "reload-hba"]) == 0
    assert [c for c in guest.named("pg_ctlcluster") if c[-1] == "reload"] == [
        ["pg_ctlcluster", "17", "c2", "reload"], ["pg_ctlcluster", "17", "c3", "reload"]]


def test_reload_hba_does_nothing_for_one_cluster(script: ModuleType) -> None:
    write_seed(script, seed())
    assert script.main(["pgcarve-clusters", "reload-hba"]) == 0  # `run` refuses every command


# -- how the image runs it --------------------------------------------------------------------


def test_usage(script: ModuleType) -> None:
    with pytest.raises(SystemExit, match="usage"):
        script.main(["pgcarve-clusters"])


def test_systemd_runs_it_around_the_main_cluster() -> None:
    system = ROOTFS / "etc" / "systemd" / "system"
    dropin = (system / "pgcarve-guest-setup.service.d" / "50-pgcarve-clusters.conf").read_text()
    assert ("ExecStartPost=/bin/sh -c 'grep -qs clusters /etc/pgcarve/instance.json || exit 0; "
            "exec /usr/bin/python3 /usr/local/sbin/pgcarve-clusters before-start'") in dropin
    assert "Wants=pgcarve-clusters.service" in dropin
    unit = (system / "pgcarve-clusters.service").read_text()
    assert "ExecStart=/usr/bin/python3 /usr/local/sbin/pgcarve-clusters after-start" in unit
    # A one-cluster seed never says "clusters" (guest/seed.py), and only such seeds skip it.
    assert "ExecCondition=/bin/grep -qs clusters /etc/pgcarve/instance.json" in unit
    one, three = (json.dumps(guest_seed(clusters=n).instance_json(), indent=2, sort_keys=True) for n in (1, 3))
    assert "clusters" not in one and '"clusters": 3' in three
    after = next(line for line in unit.splitlines() if line.startswith("After="))
    assert "postgresql.service" in after and "pgcarve-guest-passwords.service" in after
    finish = (ROOTFS / "usr" / "local" / "sbin" / "pgcarve-image-finish").read_text()
    assert "/usr/local/sbin/pgcarve-clusters" in finish
