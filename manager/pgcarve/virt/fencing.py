"""The fence in front of every change to a libvirt host.

Among several managers of a fleet only the leader may act (control/leadership.py). Each step
that changes a host (define, start, stop, undefine, metadata, volumes) runs in `acting()`, which
first calls the host's `fence` with what is about to change: the fleet's fencing check, which
raises NotLeader once this manager no longer holds the lease at the epoch its work began with.
A manager alone (no etcd) has no fence, and nothing is checked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager


class Fenced:
    """Mixed into LibvirtHost: `acting(doing)` is `translate(doing)` after the fence."""

    name: str
    fence: Callable[[str], object] | None = None

    def translate(self, doing: str) -> AbstractContextManager[None]:
        raise NotImplementedError

    @contextlib.contextmanager
    def acting(self, doing: str) -> Iterator[None]:
        if self.fence is not None:
            self.fence(f"{doing} on host {self.name}")
        with self.translate(doing):
            yield
