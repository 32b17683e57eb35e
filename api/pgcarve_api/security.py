"""The API token: from PGCARVE_TOKEN, else generated once into the state directory (0600)."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path


def load_or_create_token(explicit: str | None, token_file: Path) -> tuple[str, bool]:
    """(token, created): created is True when a new token was just written to token_file."""
    if explicit:
        return explicit, False
    if token_file.exists():
        return token_file.read_text().strip(), False
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token, True


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing reveals nothing about the token."""
    if not presented:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())
