"""pgBackRest: the guests' configuration file, the commands the manager runs in a guest, and
what `pgbackrest info --output=json` says, read into `catalog` types.

The only module of the manager that names the tool (the image installs it). One stanza per
instance, named as the instance, in a repository the hosts file names. WAL is pushed
asynchronously (`archive-async`) through a spool directory with a bound (`archive-push-queue-max`):
when the repository cannot be reached, archive_command still succeeds once the queue is full and
the WAL beyond it is dropped from the archive (pgBackRest logs it), so pg_wal never fills and
commits never stop; recovery past that gap needs a newer backup.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from pgcarve.backup.catalog import BackupRecord, BackupType, StanzaCatalog, WalRange
from pgcarve.config import BackupConfig
from pgcarve.errors import ConfigError

CONFIG_FILE = "/etc/pgbackrest.conf"
SPOOL_PATH = "/var/spool/pgbackrest"  # the async archive queue, on the guest's own disk
KEY_DIR = "/var/lib/pgcarve/backup"  # the fleet's repository key pair, postgres's only
PRIVATE_KEY = f"{KEY_DIR}/id_repository"
PROGRAM = "pgbackrest"
STANZA_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
SEGMENT_RE = re.compile(r"^[0-9A-F]{24}$")


def _stanza(name: str) -> str:
    if not STANZA_RE.fullmatch(name):
        raise ConfigError(f"{name!r} cannot name a backup stanza: lower-case letters, digits and '-', "
                          "starting with a letter, at most 63 characters")
    return name


def host_fingerprint(host_key: str) -> str:
    """The repository host key's SHA-256 fingerprint as pgBackRest compares it: hex of the hash of
    the key blob (the base64 field of its .pub line)."""
    return hashlib.sha256(base64.b64decode(host_key.split()[1])).hexdigest()


def render_config(backup: BackupConfig, stanza: str, pg_data: str) -> str:
    """/etc/pgbackrest.conf of every guest of instance `stanza` (the same file on each: any of them
    may be the primary that archives)."""
    repo = backup.repository
    lines = [
        "# Written by pgcarve (manager/pgcarve/backup/pgbackrest.py) through the guest's seed.",
        "[global]",
        f"repo1-type={repo.type}",
        f"repo1-path={repo.path}",
        f"repo1-sftp-host={repo.host}",
        f"repo1-sftp-host-port={repo.port}",
        f"repo1-sftp-host-user={repo.user}",
        f"repo1-sftp-private-key-file={PRIVATE_KEY}",
        f"repo1-sftp-public-key-file={PRIVATE_KEY}.pub",
        # The server's key is pinned: an unknown or changed one is refused, never learnt.
        "repo1-sftp-host-key-check-type=fingerprint",
        "repo1-sftp-host-key-hash-type=sha256",
        f"repo1-sftp-host-fingerprint={host_fingerprint(repo.host_key)}",
        # Many small files over SFTP: bundles cut round trips (pgBackRest's advice for SFTP).
        "repo1-bundle=y",
        f"repo1-retention-full={backup.retention_full}",
        f"repo1-retention-diff={backup.retention_diff}",
        "compress-type=zst",
        "archive-async=y",
        f"archive-push-queue-max={backup.archive_queue_max_mib}MiB",
        f"spool-path={SPOOL_PATH}",
        # A full backup starts with an immediate checkpoint, not after the next scheduled one.
        "start-fast=y",
        "log-level-console=warn",
        "log-level-file=info",
        "",
        f"[{_stanza(stanza)}]",
        f"pg1-path={pg_data}",
        "",
    ]
    return "\n".join(lines)


def archive_command(stanza: str) -> str:
    """PostgreSQL's archive_command (`%p` resolves against pg1-path)."""
    return f"{PROGRAM} --stanza={_stanza(stanza)} archive-push %p"


def stanza_create(stanza: str) -> list[str]:
    """Makes the stanza in the repository (idempotent: an existing one that matches is kept)."""
    return [PROGRAM, f"--stanza={_stanza(stanza)}", "stanza-create"]


def check(stanza: str) -> list[str]:
    """Proves archiving works: forces a WAL switch and waits for that segment in the repository."""
    return [PROGRAM, f"--stanza={_stanza(stanza)}", "--archive-timeout=60", "check"]


def backup(stanza: str, kind: BackupType) -> list[str]:
    return [PROGRAM, f"--stanza={_stanza(stanza)}", f"--type={kind.value}", "backup"]


def info(stanza: str) -> list[str]:
    return [PROGRAM, f"--stanza={_stanza(stanza)}", "--output=json", "info"]


def as_shell(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def _int(doc: dict[str, object], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} is not a whole number: {value!r}")
    return value


def _dict(doc: object, key: str) -> dict[str, object]:
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, dict):
        raise ValueError(f"{key} is missing or not an object")
    return value


def _segment(value: object, what: str) -> str:
    if not isinstance(value, str) or not SEGMENT_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a WAL segment name")
    return value


def _backup(doc: dict[str, object]) -> BackupRecord:
    stamps, archive, sizes = _dict(doc, "timestamp"), _dict(doc, "archive"), _dict(doc, "info")
    repository = _dict(sizes, "repository")
    found_lsn = doc.get("lsn")
    lsn: dict[str, object] = found_lsn if isinstance(found_lsn, dict) else {}
    prior = doc.get("prior")
    kind = doc.get("type")
    if kind not in {t.value for t in BackupType}:
        raise ValueError(f"backup type {kind!r} is not full, diff or incr")
    label = doc.get("label")
    if not isinstance(label, str) or not label:
        raise ValueError("a backup has no label")
    return BackupRecord(
        label=label, type=BackupType(kind), started_at=float(_int(stamps, "start")),
        stopped_at=float(_int(stamps, "stop")), size_bytes=_int(sizes, "size"),
        repository_bytes=_int(repository, "delta"),
        wal_start=_segment(archive.get("start"), "archive start"),
        wal_stop=_segment(archive.get("stop"), "archive stop"),
        lsn_start=str(lsn["start"]) if isinstance(lsn.get("start"), str) else None,
        lsn_stop=str(lsn["stop"]) if isinstance(lsn.get("stop"), str) else None,
        prior=prior if isinstance(prior, str) else None, error=doc.get("error") is True,
    )


def parse_info(text: str, stanza: str) -> StanzaCatalog:
    """The stanza's entry of `pgbackrest info --output=json`; ValueError (naming what) when the
    output is not what pgBackRest writes."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pgbackrest info did not print JSON: {exc}") from None
    entries = [e for e in doc if isinstance(e, dict) and e.get("name") == stanza] if isinstance(doc, list) else []
    if not entries:
        raise ValueError(f"pgbackrest info has no stanza {stanza!r}")
    entry = entries[0]
    status = _dict(entry, "status")
    message = str(status.get("message", ""))
    backups = tuple(sorted((_backup(b) for b in entry.get("backup", []) if isinstance(b, dict)),
                           key=lambda b: b.started_at))
    wal = tuple(WalRange(archive_id=str(a.get("id")), first=_segment(a.get("min"), "archive min"),
                         last=_segment(a.get("max"), "archive max"))
                for a in entry.get("archive", []) if isinstance(a, dict) and a.get("min") is not None)
    return StanzaCatalog(name=stanza, status="ok" if status.get("code") == 0 else message or "unknown",
                         backups=backups, wal=wal)


def guest_data_directory(postgresql_major: str) -> str:
    if not re.fullmatch(r"[0-9]{2}", postgresql_major):
        raise ConfigError(f"the guest image names PostgreSQL major {postgresql_major!r}, not a number like 17")
    return f"/var/lib/postgresql/{postgresql_major}/main"


def seed_document(backup: BackupConfig, stanza: str, postgresql_major: str) -> dict[str, object]:
    """The seed's `backup` section: files the guest writes as they are, and its archive_command.
    The guest needs nothing else to know about the tool. Reads the fleet's private key (refused
    unless only its owner may read it)."""
    key_path = Path(backup.repository.private_key_file)
    try:
        mode = key_path.stat().st_mode & 0o777
        private_key = key_path.read_text()
        public_key = key_path.with_name(key_path.name + ".pub").read_text()
    except OSError as exc:
        raise ConfigError(f"backup.repository.private_key_file: cannot read {key_path} or its .pub: "
                          f"{exc.strerror}") from None
    if mode & 0o077:
        raise ConfigError(f"backup.repository.private_key_file {key_path} is readable by others (mode "
                          f"{mode:04o}); it must be 0600")
    if "PRIVATE KEY-----" not in private_key:
        raise ConfigError(f"backup.repository.private_key_file {key_path} is not a PEM or OpenSSH private key")
    return {
        "stanza": _stanza(stanza),
        "config_file": CONFIG_FILE,
        "config": render_config(backup, stanza, guest_data_directory(postgresql_major)),
        "archive_command": archive_command(stanza),
        # Run by the guest (as postgres) once it is the primary: archiving needs the stanza.
        "prepare_command": stanza_create(stanza),
        "key_file": PRIVATE_KEY,
        "private_key": private_key,
        "public_key": public_key.strip() + "\n",
        "spool_path": SPOOL_PATH,
    }
