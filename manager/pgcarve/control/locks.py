"""Who is working on which instance, and which guests the manager is stopping itself.

One piece of work per instance at a time (a scale operation or a fault repair), so a repair
never races a scale-down of the same instance. And a guest the manager stops on purpose
(removal, fencing) is not a fault when libvirt reports it stopped.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class InstanceLocks:
    """A lock per instance index, with what the holder is doing."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}
        self._busy: dict[int, str] = {}
        self._keeper_welcome: set[int] = set()
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def exclusive(self, index: int, doing: str) -> Iterator[None]:
        """Hold instance `index` for one piece of work; others wait (or skip it, see busy())."""
        with self._guard:
            lock = self._locks.setdefault(index, threading.Lock())
        with lock:
            with self._guard:
                self._busy[index] = doing
            try:
                yield
            finally:
                with self._guard:
                    self._busy.pop(index, None)

    @contextlib.contextmanager
    def try_exclusive(self, index: int, doing: str) -> Iterator[bool]:
        """Hold instance `index` if nobody does (yields True), else yield False at once."""
        with self._guard:
            lock = self._locks.setdefault(index, threading.Lock())
        if not lock.acquire(blocking=False):
            yield False
            return
        with self._guard:
            self._busy[index] = doing
        try:
            yield True
        finally:
            with self._guard:
                self._busy.pop(index, None)
            lock.release()

    def busy(self, index: int) -> str | None:
        """What work holds instance `index` now, if any."""
        with self._guard:
            return self._busy.get(index)

    def all_busy(self) -> tuple[tuple[int, str], ...]:
        """Every instance held now and what for, by index (a snapshot)."""
        with self._guard:
            return tuple(sorted(self._busy.items()))

    @contextlib.contextmanager
    def welcome_keeper(self, index: int) -> Iterator[None]:
        """While the holder of `index` works only on its standbys (the primary stays where it
        is), the synchronous set may still be kept (control/primary_watch.py): a dead
        synchronous standby must not hold commits for as long as its repair takes."""
        with self._guard:
            self._keeper_welcome.add(index)
        try:
            yield
        finally:
            with self._guard:
                self._keeper_welcome.discard(index)

    def keeper_welcome(self, index: int) -> bool:
        with self._guard:
            return index in self._keeper_welcome


class PlannedStops:
    """Guests this manager stopped itself recently (so their stop event is no fault)."""

    def __init__(self, forget_after_s: float = 600.0) -> None:
        self.forget_after_s = forget_after_s
        self._since: dict[str, float] = {}
        self._guard = threading.Lock()

    def will_stop(self, name: str) -> None:
        with self._guard:
            now = time.monotonic()
            self._since = {n: t for n, t in self._since.items() if now - t < self.forget_after_s}
            self._since[name] = now

    def on_purpose(self, name: str, within_s: float = 120.0) -> bool:
        """Did this manager stop guest `name` within the last `within_s` seconds?"""
        with self._guard:
            since = self._since.get(name)
        return since is not None and time.monotonic() - since < within_s
