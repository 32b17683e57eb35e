"""The API token: from PGCARVE_TOKEN, else generated once into the state directory (0600).

A token shorter than MIN_TOKEN_LENGTH, or a token file that group or others may read or write, is
refused before the server starts: either would make the one secret guarding every mutation weak.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from pgcarve.errors import ConfigError

# 32 characters of a generated token (URL-safe base64) carry 192 bits; the minimum asks the same
# length of a token chosen by hand.
MIN_TOKEN_LENGTH = 32
GENERATE_HINT = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_token(token: str, source: str) -> None:
    """ConfigError if `token` (from `source`, e.g. "PGCARVE_TOKEN") is too short or cannot be sent
    in a header as it is. The message never contains the token."""
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(f"the API token in {source} has {len(token)} characters; at least {MIN_TOKEN_LENGTH} "
                          f"are required. Make one with: {GENERATE_HINT}")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"the API token in {source} must be printable ASCII without spaces "
                          f"(it is sent as 'Authorization: Bearer <token>'). Make one with: {GENERATE_HINT}")


def check_token_file_mode(token_file: Path) -> None:
    """ConfigError if the token file can be read or written by group or others."""
    mode = token_file.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"the API token file {token_file} has mode {mode:04o}: group or others can read or "
                          f"write it. Run `chmod 600 {token_file}`, and replace the token (delete the file; a new "
                          "one is made at start) if someone else may have read it")


def load_or_create_token(explicit: str | None, token_file: Path) -> tuple[str, bool]:
    """(token, created): created is True when a new token was just written to token_file.
    ConfigError, with nothing written, for a short token or a token file others can read."""
    if explicit:  # an empty PGCARVE_TOKEN counts as unset, as in the CLI
        check_token(explicit, "PGCARVE_TOKEN")
        return explicit, False
    if token_file.exists():
        check_token_file_mode(token_file)
        token = token_file.read_text().strip()
        check_token(token, f"the token file {token_file}")
        return token, False
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
