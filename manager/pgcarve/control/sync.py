"""Keeping each primary's synchronous set: the manager decides it, PostgreSQL does not.

With synchronous_standby_names = 'FIRST 1 (s1, s2)' PostgreSQL picks the synchronous standby
itself, so nobody can later say which standby held the last acknowledged commit. pgcarve names
exactly `replication.sync_count` standbys (FIRST k (chosen)) and records them first
(control/sync_record.py). When a chosen standby has not streamed for `switch_after_s`, another
streaming standby takes its place: the record grows to hold both, then the names change, and only
once the new ones have confirmed everything written up to the change does the record shrink.
Commits wait (never go asynchronous) while no chosen standby confirms. ANY k names every standby.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pgcarve.config import Replication
from pgcarve.control.fleet import Fleet, Instance
from pgcarve.control.sync_record import SyncRecord, SyncRecords
from pgcarve.naming import application_name, standby_name
from pgcarve.postgres import replication

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaState:
    """One standby as the primary sees it in pg_stat_replication."""

    streaming: bool
    sync_state: str
    write_lsn: int


@dataclass(frozen=True)
class KeepResult:
    """One keeper pass: what changed (words, or None), and whether a synchronous standby confirms."""

    changed: str | None
    confirming: bool


@dataclass(frozen=True)
class SyncChange:
    """Write `record` first, then (if not None) set synchronous_standby_names to `names`."""

    record: SyncRecord
    names: str | None
    reason: str


def names_for(record: SyncRecord) -> str:
    """synchronous_standby_names for a record: its synchronous standbys, FIRST k or ANY k."""
    if not record.synchronous:
        return ""
    return replication.synchronous_standby_names(record.mode, min(record.count, len(record.synchronous)),
                                                 list(record.synchronous))


def initial_record(instance: str, primary: str, primary_host: str, standbys: Sequence[str],
                   config: Replication) -> SyncRecord | None:
    """The record for a new instance: its first k standbys (all of them for ANY k)."""
    if not standbys:
        return None
    count = min(config.sync_count, len(standbys))
    chosen = tuple(standbys) if config.sync_mode == "ANY" else tuple(standbys[:count])
    return SyncRecord(instance=instance, primary=primary, primary_host=primary_host, members=chosen,
                      synchronous=chosen, count=count, mode=config.sync_mode)


def plan_sync(record: SyncRecord, standbys: Sequence[str], replicas: Mapping[str, ReplicaState], current_lsn: int,
              down_for: Mapping[str, float], switch_after_s: float) -> SyncChange | None:
    """What to change in the synchronous set now, if anything (a pure decision).

    `standbys` are the instance's standby guests in priority order, `replicas` what the primary
    sees of them, `down_for` how long each has not been streaming.
    """
    def streaming(name: str) -> bool:
        state = replicas.get(name)
        return state is not None and state.streaming

    if record.mode == "ANY":
        desired = tuple(standbys)
    else:
        live = [s for s in record.synchronous
                if s in standbys and (streaming(s) or down_for.get(s, 0.0) < switch_after_s)]
        spares = sorted((s for s in standbys if s not in live and streaming(s)),
                        key=lambda s: -replicas[s].write_lsn)
        desired = tuple(live + spares[:max(0, record.count - len(live))])
        if len(desired) < record.count and not spares:
            desired = tuple(record.synchronous)  # nobody to switch to: keep waiting on the chosen ones
    if desired and desired != record.synchronous:
        grown = record.next(members=tuple(dict.fromkeys((*record.members, *desired))), synchronous=desired,
                            pending_lsn=current_lsn)
        gone = [s for s in record.synchronous if s not in desired]
        why = (f"{', '.join(gone)} not streaming for {switch_after_s:g} s" if gone
               else "a standby became available")
        return SyncChange(grown, names_for(grown), f"synchronous standbys now {', '.join(desired)} ({why})")
    confirmed = record.synchronous and all(
        streaming(s) and replicas[s].sync_state in ("sync", "quorum")
        and replicas[s].write_lsn >= (record.pending_lsn or 0) for s in record.synchronous)
    if set(record.members) != set(record.synchronous) and record.pending_lsn is not None and confirmed:
        shrunk = record.next(members=record.synchronous, pending_lsn=None)
        return SyncChange(shrunk, None, f"{', '.join(record.synchronous)} confirmed everything written before the "
                                        "change; the others no longer hold commits only they have")
    return None


class SyncKeeper:
    """Applies plan_sync to each instance (the caller holds the instance's lock, or its holder
    welcomes the keeper: control/locks.py)."""

    def __init__(self, fleet: Fleet, records: SyncRecords, switch_after_s: float = 5.0):
        self.fleet = fleet
        self.records = records
        self.switch_after_s = switch_after_s
        self._down_since: dict[str, float] = {}
        self._lock = threading.Lock()

    def renew_lease(self, inst: Instance) -> None:
        """Only the manager's lease on the primary, nothing else: for an instance that an operation
        holds. A repair or a scale can hold it for minutes (building a standby, waiting for a host),
        and the primary's watchdog must not fence a primary the manager still looks after."""
        primary = inst.primary
        if primary is None or primary.endpoint is None or primary.info.creating:
            return
        with self.fleet.connect(primary, timeout_s=3) as conn:
            replication.renew_manager_lease(conn)

    def keep(self, inst: Instance) -> KeepResult | None:
        """One pass for one instance: renew the manager's lease on the primary, adjust its
        synchronous set. None when the primary cannot be asked (not running, no address)."""
        primary = inst.primary
        if primary is None or primary.endpoint is None or primary.info.creating:
            return None
        standbys = [g.name for g in inst.standbys]
        by_app = {application_name(s): s for s in standbys}
        with self.fleet.connect(primary, timeout_s=3) as conn:
            replication.renew_manager_lease(conn)
            if replication.in_recovery(conn):
                return self._unfence(inst, conn)
            fence = replication.write_fence(conn)
            if fence is not None:
                # Only an operation holding this instance's lock fences it, and none does now.
                replication.allow_writes(conn)
                log.warning("%s: lifted the write fence an interrupted %s left on %s; it accepts writes again",
                            inst.name, fence, primary.name)
            rows = replication.replica_rows(conn)
            current = replication.current_wal_lsn(conn)
            names_now = replication.show_synchronous_standby_names(conn)
            replicas = {by_app[app]: ReplicaState(state == "streaming", sync, lsn)
                        for app, state, sync, lsn in rows if app in by_app}
            record = self.records.get(inst.name)
            if record is None or record.primary != primary.name:
                record = self._adopt(inst, names_now, current)
            down_for = self._down_for(standbys, replicas)
            change = plan_sync(record, standbys, replicas, current, down_for, self.switch_after_s)
            if change is not None:
                self.records.put(change.record)  # first: the record is always a superset
                record = change.record
            wanted = names_for(record)
            if wanted and wanted != names_now:
                replication.set_synchronous_standby_names(conn, wanted)
        if change is not None:
            log.warning("%s: %s", inst.name, change.reason)
        confirming = [s for s in record.synchronous
                      if s in replicas and replicas[s].streaming and replicas[s].sync_state in ("sync", "quorum")]
        return KeepResult(change.reason if change else None, len(confirming) >= min(record.count, 1))

    def _unfence(self, inst: Instance, conn: replication.Connection) -> KeepResult:
        """The recorded primary is in recovery: its watchdog fenced it (no synchronous standby, no
        word from the manager). No failover replaced it (the record still names it), so it holds
        every acknowledged commit: promote it again, synchronous standbys named first."""
        assert inst.primary is not None
        record = self.records.get(inst.name)
        if record is None or record.primary != inst.primary.name or record.failover_to is not None:
            return KeepResult(None, False)
        if replication.receiving(conn):
            # A fenced primary streams from nobody. This one is a standby of another server: the
            # record predates the guests (all destroyed and made again, by Terraform say), and
            # promoting it would make a second primary.
            log.error("%s: its synchronous-set record names %s as the primary, but %s streams from another "
                      "server; not promoting it (remove %s if the instance was made again)", inst.name,
                      inst.primary.name, inst.primary.name, self.records.directory / f"{inst.name}.json")
            return KeepResult(None, False)
        replication.set_synchronous_standby_names(conn, names_for(record))
        if not replication.promote(conn, 60):
            return KeepResult(None, False)
        replication.settle_new_primary(conn)
        why = (f"{inst.primary.name} had fenced itself (no synchronous standby and no word from the manager); "
               "it is still the instance's primary, so it accepts writes again")
        log.warning("%s: %s", inst.name, why)
        return KeepResult(why, False)

    def _down_for(self, standbys: Sequence[str], replicas: Mapping[str, ReplicaState]) -> dict[str, float]:
        now = time.monotonic()
        with self._lock:
            for name in standbys:
                if name in replicas and replicas[name].streaming:
                    self._down_since.pop(name, None)
                else:
                    self._down_since.setdefault(name, now)
            return {name: now - since for name, since in self._down_since.items()}

    def _adopt(self, inst: Instance, names_now: str, current_lsn: int) -> SyncRecord:
        """A record for an instance that has none (built before records, or by Terraform): every
        standby named now may hold acknowledged commits until the chosen ones confirm."""
        assert inst.primary is not None
        config = self.fleet.config.replication
        # None yet: Terraform laid out the primary before its standby hosts, and its seed names the
        # planned standbys; recording nobody would leave its commits waiting on nobody we know of.
        standbys = [g.name for g in inst.standbys] or [
            standby_name(self.fleet.config.fleet, inst.index, s) for s in range(1, config.standbys + 1)]
        named = [s for s in standbys if application_name(s) in names_now]
        base = initial_record(inst.name, inst.primary.name, inst.primary.info.host, standbys, config)
        members = tuple(dict.fromkeys((*named, *(base.synchronous if base else ()))))
        record = SyncRecord(instance=inst.name, primary=inst.primary.name, primary_host=inst.primary.info.host,
                            members=members, synchronous=base.synchronous if base else (),
                            count=base.count if base else 1, mode=config.sync_mode,
                            pending_lsn=current_lsn if set(members) != set(base.synchronous if base else ())
                            else None)
        log.warning("%s: recorded its synchronous set (%s) for the first time", inst.name, ", ".join(members))
        return self.records.put(record)
