"""The encrypted container of `pgcarve state export`: bytes in, bytes out, nothing else.

    MAGIC | salt (16 bytes) | nonce (12 bytes) | AES-256-GCM(payload) with its 16-byte tag

The AES key is derived from the operator's fleet key with scrypt (n=2^15, r=8, p=1, the salt
above), so a fleet key that is a passphrase still costs an attacker 32 MiB and a fraction of a
second per guess. GCM authenticates the payload and, as associated data, the header: a wrong key
and a changed byte anywhere fail the same way, before anything is read from the payload. Both
primitives are the `cryptography` package's (already pgcarve's dependency, for the fleet CA).
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from pgcarve.errors import ConfigError
from pgcarve.guest.tls import check_private_file

MAGIC = b"pgcarve-state-archive/1\n"
SALT_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_MIN_BYTES = 16  # a passphrase shorter than this is too easy to guess, scrypt or not
KEY_MAX_BYTES = 4096
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1


class ArchiveUnreadable(ConfigError):
    """The archive is not one, or the fleet key does not open it (wrong key, or changed bytes)."""


def read_fleet_key(path: Path) -> bytes:
    """The fleet key in `path` (surrounding whitespace dropped). ConfigError if the file is missing,
    readable by group or others, or not KEY_MIN_BYTES to KEY_MAX_BYTES long."""
    try:
        check_private_file(path, "the fleet key file")
        key = path.read_bytes().strip()
    except FileNotFoundError:
        raise ConfigError(f"the fleet key file {path} does not exist (make one with `head -c 32 /dev/urandom | "
                          f"base64 > {path} && chmod 600 {path}`, and keep a copy apart from the backups)") from None
    except IsADirectoryError:
        raise ConfigError(f"the fleet key file {path} is a directory") from None
    if not KEY_MIN_BYTES <= len(key) <= KEY_MAX_BYTES:
        raise ConfigError(f"the fleet key in {path} is {len(key)} bytes long: it must be {KEY_MIN_BYTES} to "
                          f"{KEY_MAX_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)")
    return key


def _aead(fleet_key: bytes, salt: bytes) -> AESGCM:
    derived = Scrypt(salt=salt, length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P).derive(fleet_key)
    return AESGCM(derived)


def seal(payload: bytes, fleet_key: bytes) -> bytes:
    """`payload` encrypted and authenticated under `fleet_key`, header included."""
    salt, nonce = os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES)
    header = MAGIC + salt + nonce
    return header + _aead(fleet_key, salt).encrypt(nonce, payload, header)


def unseal(sealed: bytes, fleet_key: bytes, where: str) -> bytes:
    """The payload of `sealed`; ArchiveUnreadable if it is no pgcarve state archive, or if the key
    does not open it or any byte of it changed (GCM cannot tell those two apart, by design)."""
    header_len = len(MAGIC) + SALT_BYTES + NONCE_BYTES
    if not sealed.startswith(MAGIC):
        raise ArchiveUnreadable(f"{where} is not a pgcarve state archive (it does not start with "
                                f"{MAGIC.decode().strip()!r}; `pgcarve state export` writes them)")
    if len(sealed) < header_len + TAG_BYTES:
        raise ArchiveUnreadable(f"{where} is cut short ({len(sealed)} bytes): the archive is incomplete")
    salt = sealed[len(MAGIC):len(MAGIC) + SALT_BYTES]
    nonce = sealed[len(MAGIC) + SALT_BYTES:header_len]
    try:
        return _aead(fleet_key, salt).decrypt(nonce, sealed[header_len:], sealed[:header_len])
    except InvalidTag:
        raise ArchiveUnreadable(
            f"the fleet key does not open {where}: either it is not the key the archive was exported with, or the "
            "archive was changed or damaged since (the two cannot be told apart). Nothing was written") from None
