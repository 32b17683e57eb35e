"""The synchronous set of each instance, recorded where losing the primary's host cannot take it.

Like Patroni's /sync key: the manager decides which standbys are synchronous, and writes that
down (here, the manager's state directory) *before* it changes synchronous_standby_names, so the
record is always a superset of the standbys that may hold an acknowledged commit. Failover reads
it to prove a standby holds every acknowledged commit (control/promotion.py). Each write is
atomic and fsync'd: a crash leaves the old record or the new one, never half of either.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from pgcarve.errors import ConfigError

Mode = Literal["FIRST", "ANY"]


@dataclass(frozen=True)
class SyncRecord:
    """Who the primary is and which standbys may hold its acknowledged commits.

    ``synchronous`` are the standbys named in the primary's synchronous_standby_names now;
    ``members`` (R) are those and any named there before, until the ones named now had confirmed
    everything the primary wrote up to ``pending_lsn`` (its WAL position when the names last
    changed). ``count`` (k) is how many standbys confirm each commit. A standby provably holds
    every acknowledged commit when at least |R| - k + 1 members of R answer and it has received at
    least as much WAL as each of them. ``failover_to`` is set while a failover to that standby is
    under way, so a manager restarted half-way finishes it instead of starting another.
    """

    instance: str
    primary: str
    primary_host: str
    members: tuple[str, ...]
    synchronous: tuple[str, ...] = ()
    count: int = 1
    mode: Mode = "FIRST"
    generation: int = 1
    pending_lsn: int | None = None
    failover_to: str | None = None
    previous_primary: str | None = None  # the primary before the last failover (it rejoins, or goes)
    updated_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"{self.instance}: synchronous standby count must be >= 1, not {self.count}")
        if self.primary in self.members:
            raise ConfigError(f"{self.instance}: the primary {self.primary} cannot be its own synchronous standby")
        if not set(self.synchronous) <= set(self.members):
            raise ConfigError(f"{self.instance}: synchronous standbys {self.synchronous} must all be recorded "
                              f"members {self.members}")

    @property
    def quorum(self) -> int:
        """How many members of R must answer to prove a standby has every acknowledged commit."""
        return max(1, len(self.members) - self.count + 1)

    def next(self, **changes: object) -> SyncRecord:
        """The following generation, with `changes`."""
        return replace(self, generation=self.generation + 1, updated_at=time.time(), **changes)  # type: ignore[arg-type]

    def to_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc["members"] = list(self.members)
        doc["synchronous"] = list(self.synchronous)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> SyncRecord:
        try:
            return cls(
                instance=str(doc["instance"]), primary=str(doc["primary"]), primary_host=str(doc["primary_host"]),
                members=tuple(str(m) for m in doc["members"]),  # type: ignore[attr-defined]
                synchronous=tuple(str(m) for m in doc.get("synchronous", ())),  # type: ignore[attr-defined]
                count=int(doc.get("count", 1)),  # type: ignore[call-overload]
                mode="ANY" if doc.get("mode") == "ANY" else "FIRST",
                generation=int(doc.get("generation", 1)),  # type: ignore[call-overload]
                pending_lsn=None if doc.get("pending_lsn") is None else int(doc["pending_lsn"]),  # type: ignore[call-overload]
                failover_to=None if doc.get("failover_to") is None else str(doc["failover_to"]),
                previous_primary=None if doc.get("previous_primary") is None else str(doc["previous_primary"]),
                updated_at=float(doc.get("updated_at", 0.0)),  # type: ignore[arg-type]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"synchronous-set record is malformed: {exc}") from None


class SyncRecords:
    """One JSON file per instance in ``<state>/sync/``, written atomically and durably."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._lock = threading.Lock()

    def _file(self, instance: str) -> Path:
        return self.directory / f"{instance}.json"

    def get(self, instance: str) -> SyncRecord | None:
        path = self._file(instance)
        try:
            return SyncRecord.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"synchronous-set record {path} is not valid JSON: {exc}") from None

    def put(self, record: SyncRecord) -> SyncRecord:
        """Write `record` so that it survives a crash of this machine once put() returns."""
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self._file(record.instance)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w") as fh:
                json.dump(record.to_json(), fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(path)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return record

    def remove(self, instance: str) -> None:
        """Forget an instance (it was removed, with its data)."""
        with self._lock:
            self._file(instance).unlink(missing_ok=True)

    def all(self) -> list[SyncRecord]:
        if not self.directory.exists():
            return []
        found = [self.get(p.stem) for p in sorted(self.directory.glob("*.json"))]
        return [r for r in found if r is not None]
