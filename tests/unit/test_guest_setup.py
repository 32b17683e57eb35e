"""The image's setup script (images/rootfs/usr/local/sbin/pgcarve-guest-setup), run as a module
with its paths in a temporary directory: what a boot does for each seed, once per seed."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pgcarve.guest.seed import GuestSeed

from tests.support.seeds import guest_seed

CIDRS = ("10.77.0.0/16",)


@pytest.fixture
def booted(guest_setup: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The script's directories under tmp_path; cloning and rewinding recorded, not run."""
    for name in ("SEED", "SEED_ID", "CONF_DIR", "DATA_DIR", "STATE_DIR"):
        monkeypatch.setattr(guest_setup, name, tmp_path / {"SEED": "etc/pgcarve/instance.json",
                                                          "SEED_ID": "etc/pgcarve/seed-id",
                                                          "CONF_DIR": "etc/postgresql",
                                                          "DATA_DIR": "data/main",
                                                          "STATE_DIR": "var/lib/pgcarve"}[name])
    # Every other file the script writes moves under tmp_path too: a test never touches this
    # machine's /etc (its PostgreSQL's configuration directory has the same path as a guest's).
    for name, value in list(vars(guest_setup).items()):
        if isinstance(value, Path) and value.is_absolute() and not value.is_relative_to(tmp_path):
            if name == "STANDBYS_FILE" or name.startswith("TLS_"):
                monkeypatch.setattr(guest_setup, name, tmp_path / "etc/postgresql" / value.name)
            else:
                monkeypatch.setattr(guest_setup, name, tmp_path / "elsewhere" / value.relative_to("/"))
    (tmp_path / "etc/postgresql/conf.d").mkdir(parents=True)
    (tmp_path / "data/main").mkdir(parents=True)
    (tmp_path / "var/lib/pgcarve").mkdir(parents=True)
    calls: list[str] = []
    monkeypatch.setattr(guest_setup, "clone_from_primary", lambda seed: calls.append("clone"))
    monkeypatch.setattr(guest_setup, "rejoin_as_standby", lambda seed: calls.append("rewind"))
    state: dict[str, Any] = {"module": guest_setup, "calls": calls, "seed": None}

    def boot(seed: GuestSeed, instance_id: str) -> None:
        text = json.dumps(seed.instance_json())
        monkeypatch.setattr(guest_setup, "read_seed_disk", lambda: (text, instance_id))
        assert guest_setup.before_start() == 0

    state["boot"] = boot
    return state


def test_the_seed_lands_even_on_a_first_boot(booted: dict[str, Any], tmp_path: Path) -> None:
    """/etc/pgcarve does not exist before the first boot: the seed and its id are written there."""
    booted["boot"](guest_seed("pgc-01", "primary", CIDRS), "pgc-01-1")
    assert json.loads((tmp_path / "etc/pgcarve/instance.json").read_text())["name"] == "pgc-01"
    assert (tmp_path / "etc/pgcarve/seed-id").read_text().strip() == "pgc-01-1"
    assert "hostssl all pgcarve 10.77.0.0/16" in (tmp_path / "etc/postgresql/pg_hba.conf").read_text()
    assert booted["calls"] == []


def test_a_standby_clones_once(booted: dict[str, Any]) -> None:
    seed = guest_seed("pgc-01-s1", "standby", CIDRS, primary_host="10.77.0.12")
    booted["boot"](seed, "pgc-01-s1-1")
    booted["boot"](seed, "pgc-01-s1-1")
    assert booted["calls"] == ["clone"]


IMAGE_DATA = {"Database system identifier": "7400000000000000001", "Latest checkpoint location": "0/1527A98",
              "Database cluster state": "shut down"}


@pytest.mark.parametrize(("controldata", "copies"), [
    (IMAGE_DATA, []),  # as built: streams from the new primary's first record, no copy
    ({**IMAGE_DATA, "Latest checkpoint location": "0/3000060"}, ["clone"]),  # started since
    ({**IMAGE_DATA, "Database cluster state": "in production"}, ["clone"]),  # not shut down
    ({}, ["clone"]),  # no readable data directory
])
def test_a_standby_of_a_new_primary_starts_from_the_image_only_while_its_data_is_the_images(
        booted: dict[str, Any], monkeypatch: pytest.MonkeyPatch, controldata: dict[str, str],
        copies: list[str]) -> None:
    setup = booted["module"]
    setup.IMAGE_CHECKPOINT.parent.mkdir(parents=True)
    setup.IMAGE_CHECKPOINT.write_text("7400000000000000001 0/1527A98\n")
    monkeypatch.setattr(setup, "controldata", lambda: controldata)
    monkeypatch.setattr(setup.os, "chown", lambda *args: None)
    seed = guest_seed("pgc-01-s1", "standby", CIDRS, primary_host="10.77.0.12", from_image=True)
    booted["boot"](seed, "pgc-01-s1-1")
    booted["boot"](seed, "pgc-01-s1-1")  # a reboot: nothing again
    assert booted["calls"] == copies
    if not copies:
        assert (setup.DATA_DIR / "standby.signal").exists()
        settings = (setup.CONF_DIR / "conf.d" / "60-pgcarve-standby.conf").read_text()
        assert "host=10.77.0.12 port=5432" in settings and "primary_slot_name = 'pgcarve_pgc_01_s1'" in settings


def test_a_seed_asking_a_primary_to_start_from_the_image_is_refused() -> None:
    from pgcarve.errors import ConfigError

    with pytest.raises(ConfigError, match="only a standby starts from the image"):
        guest_seed("pgc-01", "primary", CIDRS, from_image=True)
    with pytest.raises(ConfigError, match="neither rejoins nor makes its slot"):
        guest_seed("pgc-01-s1", "standby", CIDRS, from_image=True, rejoin=True)


def test_a_former_primary_rewinds_once_per_seed_and_never_clones_over_its_data(booted: dict[str, Any]) -> None:
    primary = guest_seed("pgc-01", "primary", CIDRS)
    booted["boot"](primary, "pgc-01-1")
    rejoin = guest_seed("pgc-01", "standby", CIDRS, primary_host="10.77.1.15", rejoin=True)
    booted["boot"](rejoin, "pgc-01-2")
    booted["boot"](rejoin, "pgc-01-2")  # a reboot: the same seed, nothing again
    booted["boot"](rejoin, "pgc-01-3")  # a new seed asking again (a second failover)
    assert booted["calls"] == ["rewind", "rewind"]


def test_rewound_settings_of_the_new_primary_are_dropped(guest_setup: ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guest_setup, "DATA_DIR", tmp_path)
    (tmp_path / "postgresql.auto.conf").write_text(
        "# Do not edit\nsynchronous_standby_names = 'FIRST 1 (pgc_01_s2)'\nprimary_conninfo = 'host=x'\n"
        "primary_slot_name = 'pgcarve_pgc_01'\ndefault_transaction_read_only = 'on'\n")
    guest_setup.forget_primary_settings()
    kept = (tmp_path / "postgresql.auto.conf").read_text()
    assert "synchronous_standby_names" in kept
    assert "primary_conninfo" not in kept and "primary_slot_name" not in kept and "read_only" not in kept


def test_a_terraform_guest_lets_its_planned_peers_replicate_from_first_boot(booted: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    """No manager step: the seed's peers are let in at first boot; from then on the file is the
    manager's (a reboot with the same seed does not put back an address it took out)."""
    seed = guest_seed("pgc-01", "primary", CIDRS, replication_peers=("10.77.1.250", "10.77.2.250"))
    booted["boot"](seed, "pgc-01-terraform")
    hba = (tmp_path / "etc/postgresql/pg_hba.conf").read_text()
    assert "hostssl replication replicator 10.77.1.250/32 scram-sha-256" in hba
    assert "hostssl replication replicator 10.77.2.250/32 scram-sha-256" in hba
    standbys = tmp_path / "etc/postgresql/pgcarve-standbys"
    standbys.write_text("10.77.1.250\n")  # the manager narrowed it at run time
    booted["boot"](seed, "pgc-01-terraform")
    hba = (tmp_path / "etc/postgresql/pg_hba.conf").read_text()
    assert "10.77.2.250/32" not in hba and "10.77.1.250/32" in hba


def test_a_seed_with_a_malformed_peer_is_refused(booted: dict[str, Any]) -> None:
    seed = guest_seed("pgc-01", "primary", CIDRS)
    doc = dict(seed.instance_json(), replication_peers=["10.77.1.250 all"])
    text = json.dumps(doc)
    booted["module"].read_seed_disk = lambda: (text, "x-1")
    with pytest.raises(SystemExit, match="not a plain IP address"):
        booted["module"].before_start()


def test_a_standby_making_its_own_slot_makes_it_once_and_backs_off(guest_setup: ModuleType,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """pg_basebackup -C until one attempt made the slot; then the slot is used as it is. The
    pause between attempts doubles up to CLONE_RETRY_MAX_S."""
    answers = ["could not connect to server: Connection refused"] * 5 + [
        'replication slot "pgc_01_s1" already exists', ""]
    runs: list[list[str]] = []
    pauses: list[float] = []

    class Done:
        def __init__(self, args: list[str], stderr: str):
            self.args, self.stderr, self.returncode = args, stderr, 0 if not stderr else 1

    def run(args: list[str], **kwargs: Any) -> Any:
        if args[0] == "runuser":
            runs.append(args)
            return Done(args, answers[len(runs) - 1])
        return Done(args, "")

    monkeypatch.setattr(guest_setup.subprocess, "run", run)
    monkeypatch.setattr(guest_setup.time, "sleep", pauses.append)
    monkeypatch.setattr(guest_setup, "standby_settings", lambda seed, conninfo: None)
    seed = guest_seed("pgc-01-s1", "standby", CIDRS, primary_host="10.77.0.250", create_slot=True)
    guest_setup.clone_from_primary(seed.instance_json())
    assert ["-C" in r for r in runs] == [True] * 6 + [False]
    assert all(seed.instance_json()["slot_name"] in r for r in runs)
    assert pauses == [1, 2, 4, 8, 8]


def test_the_seeds_hostname_is_set_and_resolves_without_cloud_init(booted: dict[str, Any],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The image runs no cloud-init: the script sets the seed's hostname and Debian's 127.0.1.1 line
    itself, replacing the image's line and keeping the others."""
    module = booted["module"]
    ran: list[list[str]] = []
    monkeypatch.setattr(module.subprocess, "run", lambda argv, **_kw: ran.append(list(argv)))
    module.HOSTNAME_FILE.parent.mkdir(parents=True, exist_ok=True)
    module.HOSTS_FILE.write_text("127.0.0.1\tlocalhost\n127.0.1.1\tpgcarve-guest\n::1\tlocalhost ip6-localhost\n")
    module.set_hostname("pgc-01-s1")
    assert module.HOSTNAME_FILE.read_text() == "pgc-01-s1\n"
    assert module.HOSTS_FILE.read_text().splitlines() == ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost",
                                                          "127.0.1.1\tpgc-01-s1"]
    assert ran == [["hostname", "pgc-01-s1"]]
