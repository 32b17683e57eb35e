"""Every couple of seconds, each primary: the manager's lease renewed, its synchronous set kept
(control/sync.py), and how long it has gone without a confirming synchronous standby.

The supervisor reads `unconfirmed_for` to tell an isolated primary (it answers, but no standby
confirms its commits for recovery.host_timeout_s) from one that is merely busy. Instances being
scaled or repaired are never waited for: their primary's lease is renewed and nothing else (a
new primary right after a failover must not fence itself while its repair goes on), except while
a repair mends only standbys: then the synchronous set is kept too, so commits go on with the
other standby while a dead synchronous one is restarted or rebuilt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import psycopg

from pgcarve.control.fleet import Fleet, Instance
from pgcarve.control.sync import SyncKeeper
from pgcarve.errors import PgcarveError
from pgcarve.postgres.session import first_line

log = logging.getLogger(__name__)


class PrimaryWatch:
    def __init__(self, fleet: Fleet, view: Callable[[], Sequence[Instance]], tick_s: float = 2.0):
        self.fleet = fleet
        self.view = view
        self.tick_s = tick_s
        self.keeper = SyncKeeper(fleet, fleet.sync_records, fleet.config.recovery.sync_switch_after_s)
        self._unconfirmed_since: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pgcarve-primary-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def unconfirmed_for(self, instance: str) -> float:
        """Seconds the instance's primary has answered without a synchronous standby confirming
        (0.0 when one confirms, or when the primary could not be asked at all)."""
        with self._lock:
            since = self._unconfirmed_since.get(instance)
        return 0.0 if since is None else time.monotonic() - since

    def pass_once(self) -> None:
        """One pass over every instance (also what tests call)."""
        for inst in self.view():
            if not self.fleet.config.replication.standbys or inst.primary is None or inst.roles_mismatch:
                continue  # (an instance made under Patroni is Patroni's: control/roles_guard.py)
            with self.fleet.locks.try_exclusive(inst.index, "keeping the synchronous set") as held:
                try:
                    if not held and not self.fleet.locks.keeper_welcome(inst.index):
                        # An operation holds it: the lease only (it renews nothing else).
                        self.keeper.renew_lease(inst)
                        continue
                    result = self.keeper.keep(inst)
                except (psycopg.Error, PgcarveError) as exc:
                    log.debug("%s: primary not asked this pass: %s", inst.name, first_line(exc))
                    result = None
            with self._lock:
                if result is None or result.confirming:
                    self._unconfirmed_since.pop(inst.name, None)
                else:
                    self._unconfirmed_since.setdefault(inst.name, time.monotonic())

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.pass_once()
            except Exception:  # a bug must not stop the lease and the synchronous set
                log.exception("primary watch pass failed")
