"""The backup module (backup/pgbackrest.py): the guests' configuration, the command lines, the
catalog read from `pgbackrest info --output=json` (recorded from a guest in tests/data/pgbackrest/),
the hosts file's backup section, and what the guest's setup makes of the seed's backup part."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pgcarve.backup import pgbackrest
from pgcarve.backup.catalog import BackupType
from pgcarve.config import BackupConfig, FleetConfig
from pgcarve.errors import ConfigError

from tests.support.seeds import guest_seed
from tests.unit.test_guest_patroni import PATRONI
from tests.unit.test_guest_setup import booted  # noqa: F401  (the fixture)

DATA = Path(__file__).resolve().parents[1] / "data" / "pgbackrest"
HOST_KEY = "ssh-rsa " + base64.b64encode(b"\x00\x00\x00\x07ssh-rsa" + b"k" * 64).decode()
HOSTS = [{"name": "h0", "uri": "test:///default", "role": "primary"},
         {"name": "h1", "uri": "test:///default", "role": "standby"},
         {"name": "h2", "uri": "test:///default", "role": "standby"}]


def backup_section(key_file: str = "/s/backup/id_repository", **changes: Any) -> dict[str, Any]:
    section: dict[str, Any] = {"repository": {"host": "10.76.0.250", "path": "/repo", "user": "root",
                                              "host_key": HOST_KEY, "private_key_file": key_file}}
    section.update(changes)
    return section


def key_pair(tmp_path: Path, mode: int = 0o600) -> Path:
    key = tmp_path / "id_repository"
    key.write_text("-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n")
    key.chmod(mode)
    key.with_name("id_repository.pub").write_text("ssh-rsa AAAAB3Nza pgcarve\n")
    return key


def test_the_configuration_pins_the_repository_host_key_and_bounds_the_archive_queue() -> None:
    config = BackupConfig.model_validate(backup_section(archive_queue_max_mib=256, retention_full=3))
    text = pgbackrest.render_config(config, "pgc-01", "/var/lib/postgresql/17/main")
    lines = set(text.splitlines())
    fingerprint = hashlib.sha256(base64.b64decode(HOST_KEY.split()[1])).hexdigest()
    assert {"repo1-type=sftp", "repo1-sftp-host=10.76.0.250", "repo1-path=/repo",
            "repo1-sftp-host-key-check-type=fingerprint", "repo1-sftp-host-key-hash-type=sha256",
            f"repo1-sftp-host-fingerprint={fingerprint}", "archive-async=y", "archive-push-queue-max=256MiB",
            "repo1-retention-full=3", "[pgc-01]", "pg1-path=/var/lib/postgresql/17/main"} <= lines
    assert pgbackrest.archive_command("pgc-01") == "pgbackrest --stanza=pgc-01 archive-push %p"
    assert pgbackrest.backup("pgc-01", BackupType.DIFF)[-2:] == ["--type=diff", "backup"]
    with pytest.raises(ConfigError, match="cannot name a backup stanza"):
        pgbackrest.render_config(config, "pgc-01]\n[global", "/data")


@pytest.mark.parametrize(("change", "words"), [
    ({"diff_every_hours": 200, "full_every_days": 7}, "longer than the time between full backups"),
    ({"archive_queue_max_mib": 8}, "greater than or equal to 64"),
    ({"repository": {"host": "repo.example", "path": "/repo", "host_key": HOST_KEY,
                     "private_key_file": "/k"}}, "not a plain IP address"),
    ({"repository": {"host": "10.0.0.9", "path": "repo", "host_key": HOST_KEY,
                     "private_key_file": "/k"}}, "must be an absolute path"),
    ({"repository": {"host": "10.0.0.9", "path": "/repo", "host_key": "AAAA",
                     "private_key_file": "/k"}}, "host_key must be 'TYPE BASE64'"),
])
def test_the_hosts_file_refuses_a_bad_backup_section_by_name(change: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        FleetConfig.model_validate({"hosts": HOSTS, "backup": {**backup_section(), **change}})


def test_the_seed_part_carries_the_key_only_when_no_one_else_may_read_it(tmp_path: Path) -> None:
    key = key_pair(tmp_path)
    config = BackupConfig.model_validate(backup_section(str(key)))
    doc = pgbackrest.seed_document(config, "pgc-01", "17")
    assert doc["private_key"] == key.read_text() and doc["stanza"] == "pgc-01"
    assert "pg1-path=/var/lib/postgresql/17/main" in str(doc["config"])
    with pytest.raises(ConfigError, match="PostgreSQL major"):
        pgbackrest.seed_document(config, "pgc-01", "")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by others.*0600"):
        pgbackrest.seed_document(config, "pgc-01", "17")


def test_the_catalog_has_each_backup_and_the_recoverable_window() -> None:
    catalog = pgbackrest.parse_info((DATA / "info.json").read_text(), "pgc-00")
    assert catalog.status == "ok" and catalog.backups
    full = catalog.backups[0]
    assert full.type is BackupType.FULL and full.size_bytes > 0 and full.stopped_at >= full.started_at
    assert full.wal_start <= full.wal_stop
    diff = catalog.backups[1]
    assert diff.type is BackupType.DIFF and diff.prior == full.label and diff.repository_bytes < full.repository_bytes
    window = catalog.window
    assert window is not None and window.earliest == min(b.stopped_at for b in catalog.backups)
    assert window.wal_last is not None and window.wal_last >= catalog.backups[-1].wal_stop


def test_a_booted_guests_catalog_after_its_first_full_backup() -> None:
    catalog = pgbackrest.parse_info((DATA / "info-guest.json").read_text(), "pgc-01")
    (full,) = catalog.backups
    assert full.type is BackupType.FULL and full.prior is None and full.size_bytes > 30 * 2**20
    assert catalog.wal[0].first.endswith("01"), "archived from the instance's first segment"
    window = catalog.window
    assert window is not None and window.earliest == window.latest_proven == full.stopped_at


def test_a_stanza_without_backups_has_no_window_and_bad_output_is_named() -> None:
    doc = json.loads((DATA / "info.json").read_text())
    doc[0]["backup"] = []
    assert pgbackrest.parse_info(json.dumps(doc), "pgc-00").window is None
    with pytest.raises(ValueError, match="no stanza 'pgc-09'"):
        pgbackrest.parse_info(json.dumps(doc), "pgc-09")
    with pytest.raises(ValueError, match="did not print JSON"):
        pgbackrest.parse_info("ERROR: [056]: unable to find primary cluster", "pgc-00")
    doc[0]["backup"] = [{"label": "x", "type": "weekly"}]
    with pytest.raises(ValueError, match=r"missing or not an object|not full, diff or incr"):
        pgbackrest.parse_info(json.dumps(doc), "pgc-00")


def _seed_backup(tmp_path: Path) -> dict[str, object]:
    config = BackupConfig.model_validate(backup_section(str(key_pair(tmp_path))))
    doc = pgbackrest.seed_document(config, "pgc-01", "17")
    # The guest writes wherever the seed says: here, under tmp_path, not this machine's /etc.
    return {**doc, "config_file": str(tmp_path / "etc/pgbackrest.conf"),
            "key_file": str(tmp_path / "var/lib/pgcarve/backup/id_repository"),
            "spool_path": str(tmp_path / "var/spool/pgbackrest")}


def test_a_guest_archives_through_the_seeds_command_and_keeps_the_key_private(
        booted: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    setup: ModuleType = booted["module"]
    backup = _seed_backup(tmp_path)
    booted["boot"](guest_seed("pgc-01", "primary", backup=backup), "pgc-01-1")
    settings = (setup.CONF_DIR / "conf.d" / "56-pgcarve-replication.conf").read_text()
    assert "archive_mode = 'on'" in settings
    assert "archive_command = 'pgbackrest --stanza=pgc-01 archive-push %p'" in settings
    key = Path(str(backup["key_file"]))
    assert key.read_text() == backup["private_key"] and key.stat().st_mode & 0o777 == 0o600
    assert key.parent.stat().st_mode & 0o077 == 0
    assert Path(str(backup["config_file"])).read_text() == backup["config"]
    assert Path(str(backup["spool_path"])).is_dir()


def test_under_patroni_archiving_is_in_patronis_parameters(booted: dict[str, Any], tmp_path: Path,  # noqa: F811
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    setup: ModuleType = booted["module"]
    monkeypatch.setattr(setup, "own_address", lambda: "10.77.1.5")
    booted["boot"](guest_seed("pgc-01-s1", "standby", patroni=PATRONI, backup=_seed_backup(tmp_path)),
                   "pgc-01-s1-1")
    parameters = json.loads(setup.PATRONI_CONFIG.read_text())["postgresql"]["parameters"]
    assert parameters["archive_mode"] == "on"
    assert parameters["archive_command"] == "pgbackrest --stanza=pgc-01 archive-push %p"


def test_a_seed_with_a_bad_archive_command_is_refused(booted: dict[str, Any], tmp_path: Path) -> None:  # noqa: F811
    backup = {**_seed_backup(tmp_path), "archive_command": "pgbackrest archive-push %p; rm -rf /"}
    with pytest.raises(SystemExit, match="archive_command"):
        booted["boot"](guest_seed("pgc-01", "primary", backup=backup), "pgc-01-1")
    assert not os.path.exists(str(backup["key_file"]))


def test_the_primary_prepares_the_repository_once_and_a_standby_leaves_it(
        booted: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    setup: ModuleType = booted["module"]
    booted["boot"](guest_seed("pgc-01", "primary", backup=_seed_backup(tmp_path)), "pgc-01-1")
    ran: list[list[str]] = []
    in_recovery = {"answer": "t"}

    class Done:
        def __init__(self, stdout: str = "") -> None:
            self.returncode, self.stdout, self.stderr = 0, stdout, ""

    def run(argv: list[str], **_kw: Any) -> Done:
        ran.append(argv)
        return Done(in_recovery["answer"] if "psql" in argv else "")

    monkeypatch.setattr(setup.subprocess, "run", run)
    assert setup.backup_stanza() == 0 and not any("stanza-create" in a for a in ran), "a standby leaves it"
    in_recovery["answer"] = "f"
    assert setup.backup_stanza() == 0
    assert [a[-1] for a in ran if "stanza-create" in a] == ["stanza-create"]
    assert ran[-1][:4] == ["runuser", "-u", "postgres", "--"]
    assert setup.backup_stanza() == 0 and len([a for a in ran if "stanza-create" in a]) == 1, "once per stanza"


def test_the_sandbox_repository_host_is_sftp_only_by_key_and_its_key_is_pinned(tmp_path: Path) -> None:
    """What `pgcarve sandbox up` makes for its repository host (no namespace or sshd started here)."""
    from pgcarve.sandbox.repository import SandboxRepository

    repo = SandboxRepository(tmp_path, "abc123", "pgc-abc123-wire")
    repo._prepare()
    sshd = set((repo.host_key.parent / "sshd_config").read_text().splitlines())
    assert {"ForceCommand internal-sftp", "PasswordAuthentication no", "PermitRootLogin prohibit-password",
            "AllowTcpForwarding no", "ListenAddress 10.76.0.250:22"} <= sshd
    assert repo.client_key.stat().st_mode & 0o077 == 0
    config = repo.config()
    assert config.repository.host_key == " ".join(repo.host_key.with_suffix(".pub").read_text().split()[:2])
    authorized = (repo.host_key.parent / "authorized_keys").read_text()
    assert authorized.split()[:2] == repo.client_key.with_suffix(".pub").read_text().split()[:2]
    assert "-----BEGIN RSA PRIVATE KEY-----" in repo.client_key.read_text(), "PEM: what libssh2 reads"


def test_the_advisors_throw_away_fleets_do_not_archive() -> None:
    from pgcarve.advice.cases import with_size

    config = FleetConfig.model_validate({"hosts": HOSTS, "backup": backup_section()})
    assert config.backup is not None and with_size(config, vcpus=2).backup is None
