"""PostgreSQL passwords, kept by the manager in its state directory (files of mode 0600).

Two kinds:

* the fleet's: the admin login's password (postgres.session.ADMIN_USER), the same on every guest,
  used only by the manager (`<state>/secrets.json`);
* each instance's own (`<state>/instances/<instance>.json`): the application role's password and
  the replication role's. Knowing one instance's passwords opens no other instance.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pgcarve.errors import ConfigError, NotFound, StateMissing

SECRET_RE = re.compile(r"^[A-Za-z0-9]{16,128}$")
INSTANCE_FILE_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


def new_secret() -> str:
    """A random alphanumeric password (safe in DSNs, conninfo strings and YAML unquoted)."""
    return secrets.token_hex(24)


def _check_secret(value: object, what: str) -> None:
    if not isinstance(value, str) or not SECRET_RE.fullmatch(value):
        raise ConfigError(f"credentials: the {what} must be 16-128 letters or digits")


def _write_private_json(path: Path, doc: dict[str, str]) -> Path:
    """Write `doc` to a new file beside `path`, 0600 from its creation and on disk; returns it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


def _create_private_json(path: Path, doc: dict[str, str]) -> bool:
    """Make `path` hold `doc` (0600) unless it exists; False if it did. Atomic without a lock: the
    file appears whole through a hard link, which fails if another process made it first (so
    instances being created side by side never wait for each other's fsync)."""
    tmp = _write_private_json(path, doc)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


@dataclass(frozen=True)
class Credentials:
    """The fleet's admin password (postgres.session.ADMIN_USER): the manager's login everywhere."""

    admin_password: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_secret(self.admin_password, "admin password")


def load_credentials(secrets_file: Path) -> Credentials:
    """The fleet's admin password, read from its 0600 file; StateMissing if there is none. It is
    made only for a new fleet (`create_credentials`, after control/state_check.py found no guest):
    one made over running guests would lock the manager out of all of them. (A file from before
    per-instance credentials also holds a fleet-wide replication password: no guest made now uses it.)"""
    try:
        data = json.loads(secrets_file.read_text())
    except FileNotFoundError:
        raise StateMissing(
            f"the fleet's admin password ({secrets_file}) is missing: every guest of the fleet knows only the "
            f"one it was made with. Restore it with `pgcarve state import BACKUP --key-file KEY` (a new fleet "
            "makes one when `pgcarve up` or `pgcarve serve` first starts)") from None
    return Credentials(admin_password=data["admin_password"])


def create_credentials(secrets_file: Path) -> Credentials:
    """A new admin password for a new fleet, in a new 0600 file; ConfigError if the file exists."""
    creds = Credentials(admin_password=new_secret())
    secrets_file.parent.mkdir(parents=True, exist_ok=True)
    if not _create_private_json(secrets_file, {"admin_password": creds.admin_password}):
        raise ConfigError(f"{secrets_file} exists already: the fleet has an admin password")
    return creds


@dataclass(frozen=True)
class InstanceSecrets:
    """One instance's own passwords: its application role's and its replication role's."""

    app_password: str = field(repr=False)
    replication_password: str = field(repr=False)
    # The REST API password of the instance's Patroni members (none for an instance made before).
    patroni_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_secret(self.app_password, "application password")
        _check_secret(self.replication_password, "replication password")
        if self.patroni_password is not None:
            _check_secret(self.patroni_password, "Patroni REST API password")


class InstanceSecretStore:
    """Each instance's passwords, one 0600 file per instance in a 0700 directory.

    Made when the instance's primary is seeded (`create`), read for its standbys and clients
    (`load`), deleted with the instance (`remove`): a later instance of the same name gets new ones.
    """

    def __init__(self, directory: Path):
        self.directory = directory

    def _file(self, instance: str) -> Path:
        if not INSTANCE_FILE_RE.fullmatch(instance):
            raise ConfigError(f"{instance!r} is not an instance name")
        return self.directory / f"{instance}.json"

    def exists(self, instance: str) -> bool:
        return self._file(instance).exists()

    def load(self, instance: str) -> InstanceSecrets:
        """The instance's passwords; NotFound if none were ever made for it."""
        path = self._file(instance)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFound(
                f"no credentials recorded for instance {instance} (expected {path}): it was created before "
                "per-instance credentials, or by another state directory. Scale it away and create it again "
                "to give it an application role") from None
        return InstanceSecrets(app_password=data["app_password"], replication_password=data["replication_password"],
                               patroni_password=data.get("patroni_password"))

    def load_or_create(self, instance: str) -> InstanceSecrets:
        """The instance's passwords, made (random, 0600) if it has none yet."""
        path = self._file(instance)
        if path.exists():
            return self.load(instance)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        app, replication, patroni = new_secret(), new_secret(), new_secret()
        made = InstanceSecrets(app_password=app, replication_password=replication, patroni_password=patroni)
        if _create_private_json(path, {"app_password": app, "replication_password": replication,
                                       "patroni_password": patroni}):
            return made
        return self.load(instance)  # another process made them first: theirs are the ones

    def remove(self, instance: str) -> None:
        """Forget the instance's passwords (its guests are gone)."""
        self._file(instance).unlink(missing_ok=True)
