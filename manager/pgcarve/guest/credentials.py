"""The fleet's PostgreSQL passwords, kept by the manager in its state directory (mode 0600)."""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import ConfigError

SECRET_RE = re.compile(r"^[A-Za-z0-9]{16,128}$")


def new_secret() -> str:
    """A random alphanumeric password (safe in DSNs, conninfo strings and YAML unquoted)."""
    return secrets.token_hex(24)


@dataclass(frozen=True)
class Credentials:
    """The admin login's (postgres.session.ADMIN_USER) and the standbys' (REPLICATION_USER) passwords."""

    admin_password: str
    replication_password: str

    def __post_init__(self) -> None:
        for value in (self.admin_password, self.replication_password):
            if not SECRET_RE.fullmatch(value):
                raise ConfigError("credentials: passwords must be 16-128 letters or digits")


def load_credentials(secrets_file: Path) -> Credentials:
    """The fleet's passwords, created on first use in a 0600 file."""
    if secrets_file.exists():
        data = json.loads(secrets_file.read_text())
        return Credentials(admin_password=data["admin_password"], replication_password=data["replication_password"])
    creds = Credentials(admin_password=new_secret(), replication_password=new_secret())
    secrets_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(secrets_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"admin_password": creds.admin_password, "replication_password": creds.replication_password}, fh)
    return creds
