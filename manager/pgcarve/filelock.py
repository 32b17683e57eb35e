"""An exclusive lock on a file beside state that several pgcarve processes may create at once
(the CLI and the API server starting together): whoever holds it makes the state, the others
then find it made."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def locked(lock_file: Path, directory_mode: int = 0o700) -> Iterator[None]:
    """Hold an exclusive flock on `lock_file` (made, with its directory, if missing)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True, mode=directory_mode)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
