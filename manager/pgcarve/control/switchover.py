"""A planned switchover: the chosen standby takes over the primary's role with nothing lost.

1. The target becomes the synchronous standby, if it is not (recorded first, control/sync.py),
   and confirms; 2. the primary refuses new writes and ends its sessions (the pause starts);
3. the target replays everything the primary wrote; 4. a failover to it (control/failover.py:
   the old primary is powered off and rejoins later as a standby, rewound, its disk kept);
5. the new primary accepts writes (the pause ends). The pause is measured and reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from pgcarve.control.failover import Failover, refuse_several_clusters
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.sync import names_for
from pgcarve.control.sync_record import SyncRecord
from pgcarve.errors import Conflict, GuestNotReady, NotFound
from pgcarve.postgres import replication


@dataclass(frozen=True)
class SwitchoverOutcome:
    instance: str
    old_primary: str
    new_primary: str
    host: str
    write_pause_s: float  # from refusing new writes on the old primary to accepting them on the new

    @property
    def message(self) -> str:
        return (f"switched over from {self.old_primary} to {self.new_primary} on {self.host}; writes paused "
                f"{self.write_pause_s:.1f} s")


class Switchover:
    def __init__(self, fleet: Fleet, provisioner: Provisioner, confirm_timeout_s: float = 120.0):
        self.fleet = fleet
        self.failover = Failover(fleet, provisioner)
        self.confirm_timeout_s = confirm_timeout_s

    def target_of(self, inst: Instance, to: str | None) -> Guest:
        """The standby to switch to: `to`, else the synchronous one, else the first that streams."""
        standbys = [g for g in inst.standbys if g.info.state == "running" and g.endpoint is not None]
        if to is not None:
            chosen = next((g for g in standbys if g.name == to), None)
            if chosen is None:
                names = ", ".join(g.name for g in standbys) or "none"
                raise NotFound(f"{inst.name} has no running standby {to!r} to switch over to (running: {names})")
            return chosen
        record = self.fleet.sync_records.get(inst.name)
        synchronous = record.synchronous if record else ()
        ordered = sorted(standbys, key=lambda g: (g.name not in synchronous, g.info.metadata.standby))
        if not ordered:
            raise Conflict(f"{inst.name} has no running standby to switch over to")
        return ordered[0]

    def run(self, inst: Instance, to: str | None = None, progress: Progress = no_progress) -> SwitchoverOutcome:
        """Switch `inst` over; the caller holds the instance's lock."""
        refuse_several_clusters(self.fleet, inst, "switch over")
        primary = inst.primary
        if primary is None or primary.info.state != "running" or primary.endpoint is None:
            raise Conflict(f"{inst.name}: the primary is not running; a failover, not a switchover, is needed")
        target = self.target_of(inst, to)
        record = self.fleet.sync_records.get(inst.name)
        if record is None:
            raise GuestNotReady(f"{inst.name}: its synchronous set is not recorded yet; try again in a few seconds")
        with self.fleet.connect(primary, timeout_s=10) as conn:
            if target.name not in record.synchronous:
                progress(target.name, "becoming the synchronous standby", 0.1)
                record = self._make_synchronous(conn, record, target)
            self._wait(lambda: replication.synchronous_standbys_at(conn, [target.name],
                                                                   _lsn_text(replication.current_wal_lsn(conn))),
                       f"{target.name} to confirm as the synchronous standby")
            progress(primary.name, "refusing new writes (the pause starts)", 0.3)
            paused_at = time.monotonic()
            lsn = replication.refuse_writes(conn, "switchover")
            try:
                self._wait(lambda: replication.synchronous_standbys_at(conn, [target.name], lsn),
                           f"{target.name} to replay everything {primary.name} wrote (up to {lsn})")
            except GuestNotReady:
                replication.allow_writes(conn)  # nothing switched: the primary writes again
                raise
        progress(target.name, "taking over", 0.6)
        now = self.fleet.instance_at(inst.index) or inst
        outcome = self.failover.run(now, to=target.name, progress=progress)
        pause = time.monotonic() - paused_at
        return SwitchoverOutcome(inst.name, primary.name, outcome.new_primary, outcome.host, round(pause, 2))

    def _make_synchronous(self, conn: psycopg.Connection[tuple[object, ...]], record: SyncRecord,
                          target: Guest) -> SyncRecord:
        synchronous = (target.name, *(s for s in record.synchronous if s != target.name))[:record.count]
        if record.mode == "ANY":
            synchronous = tuple(dict.fromkeys((*record.synchronous, target.name)))
        grown = record.next(members=tuple(dict.fromkeys((*record.members, *synchronous))), synchronous=synchronous,
                            pending_lsn=replication.current_wal_lsn(conn))
        self.fleet.sync_records.put(grown)  # recorded first
        replication.set_synchronous_standby_names(conn, names_for(grown))
        return grown

    def _wait(self, done: Callable[[], object], what: str) -> None:
        deadline = time.monotonic() + self.confirm_timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise GuestNotReady(f"switchover: waited {self.confirm_timeout_s:.0f} s for {what}; nothing was "
                                    "switched, the primary accepts writes as before")
            time.sleep(0.2)


def _lsn_text(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"

