"""What a repository holds for one instance, in terms that do not depend on the backup tool."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BackupType(StrEnum):
    FULL = "full"
    DIFF = "diff"  # changes since the last full backup
    INCR = "incr"  # changes since the last backup of any type


@dataclass(frozen=True)
class BackupRecord:
    """One finished backup: restoring it needs the WAL from `wal_start` to `wal_stop` at least."""

    label: str
    type: BackupType
    started_at: float  # UNIX time
    stopped_at: float
    size_bytes: int  # the database as the backup saw it
    repository_bytes: int  # what this backup added to the repository (compressed, only changed files)
    wal_start: str  # WAL segment names
    wal_stop: str
    lsn_start: str | None
    lsn_stop: str | None
    prior: str | None  # the backup a diff or incr is based on
    error: bool  # pgBackRest found checksum errors while copying


@dataclass(frozen=True)
class WalRange:
    """Archived WAL of one database generation (min and max segment names, inclusive; a
    promotion's new timeline continues it)."""

    archive_id: str
    first: str
    last: str


@dataclass(frozen=True)
class RecoverableWindow:
    """From the oldest backup's end (the earliest point a restore can stop at) to the newest
    archived WAL (whose exact time the repository does not record: the stopped_at of the newest
    backup is the latest time it proves; WAL archived after it extends the window towards now)."""

    earliest: float
    latest_proven: float
    wal_last: str | None  # the newest archived segment


@dataclass(frozen=True)
class StanzaCatalog:
    """One instance's backups (oldest first), its archived WAL and its recoverable window."""

    name: str
    status: str  # "ok", or the tool's words for what is wrong
    backups: tuple[BackupRecord, ...]
    wal: tuple[WalRange, ...]

    @property
    def window(self) -> RecoverableWindow | None:
        """None while there is no backup to restore from."""
        good = [b for b in self.backups if not b.error]
        if not good:
            return None
        wal_last = max((r.last for r in self.wal), default=None)
        return RecoverableWindow(earliest=min(b.stopped_at for b in good),
                                 latest_proven=max(b.stopped_at for b in good), wal_last=wal_last)
