"""Failing over: promote a standby that provably holds every acknowledged commit.

Each step is safe to repeat, and the synchronous-set record (control/sync_record.py) remembers
the chosen standby (`failover_to`) before anything changes, so a manager killed between any two
steps finishes the same failover when it starts again, never a second one:

1. fence the old primary if its host answers: power it off, keeping its disk (it rejoins later
   as a standby with pg_rewind: Provisioner.rejoin); a primary on a lost host fences itself (the
   guest's watchdog) when it has neither a synchronous standby nor word from the manager;
2. detach every standby that answers from the old primary, so no commit can be acknowledged
   after their WAL positions are read (at most k - 1 members of the record still stream);
3. decide (control/promotion.py): those positions against the record's quorum, or an operator's
   forced choice; record the new primary and its synchronous standbys (`failover_to` set);
4. on the chosen standby, still in recovery: slots for the others and synchronous_standby_names,
   so the first commit after promotion already waits for a synchronous standby;
5. the other standbys follow it (cascading until it is promoted, then on its new timeline);
6. promote; 7. metadata and record say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import psycopg

from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.promotion import Promotion, StandbyAnswer, decide, force
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.sync import names_for
from pgcarve.control.sync_record import SyncRecord
from pgcarve.errors import Conflict, FailoverRefused, GuestNotReady, PgcarveError
from pgcarve.failpoints import failpoint
from pgcarve.naming import slot_name
from pgcarve.postgres import replication
from pgcarve.postgres.session import first_line

log = logging.getLogger(__name__)


def refuse_several_clusters(fleet: Fleet, inst: Instance, action: str) -> None:
    """Conflict for an instance whose guests run several PostgreSQL clusters (instance.clusters,
    the benchmark's layout): the manager moves only the first, and clusters 2..N would go on
    following the old primary, or come up as primaries of their own on a rejoined guest."""
    if fleet.config.instance.clusters > 1:
        raise Conflict(f"{inst.name}: will not {action}: its guests run {fleet.config.instance.clusters} "
                       "PostgreSQL clusters (instance.clusters), and the manager moves only the first; "
                       "this layout is for the benchmark")


@dataclass(frozen=True)
class FailoverOutcome:
    """What a failover did, for the incident, the API and the log."""

    instance: str
    old_primary: str | None
    new_primary: str
    host: str
    proven: bool  # False: forced by an operator, see may_be_missing
    reason: str
    may_be_missing: str = ""

    @property
    def message(self) -> str:
        text = f"failed over from {self.old_primary or 'a lost primary'} to {self.new_primary} on {self.host}"
        if not self.proven:
            text += f" (forced: may be missing {self.may_be_missing})"
        return text


class Failover:
    def __init__(self, fleet: Fleet, provisioner: Provisioner):
        self.fleet = fleet
        self.provisioner = provisioner

    # -- asking ----------------------------------------------------------------------------------

    def answers(self, inst: Instance) -> list[StandbyAnswer]:
        """Every standby of the instance, asked for its WAL position."""
        return [self._ask(guest) for guest in inst.standbys]

    def _ask(self, guest: Guest) -> StandbyAnswer:
        if guest.endpoint is None or guest.info.state != "running":
            return StandbyAnswer(guest.name, guest.info.host, answered=False)
        try:
            with self.fleet.connect(guest, timeout_s=5) as conn:
                recovering, position = replication.wal_position(conn)
        except psycopg.Error as exc:
            log.warning("%s did not answer for failover: %s", guest.name, first_line(exc))
            return StandbyAnswer(guest.name, guest.info.host, answered=False)
        return StandbyAnswer(guest.name, guest.info.host, answered=True, in_recovery=recovering,
                             received_lsn=position)

    def _record(self, inst: Instance) -> SyncRecord:
        record = self.fleet.sync_records.get(inst.name)
        if record is not None:
            return record
        # No record (an instance from before records): every standby may hold acknowledged commits.
        standbys = tuple(g.name for g in inst.standbys)
        primary = inst.primary
        config = self.fleet.config.replication
        return SyncRecord(instance=inst.name, primary=primary.name if primary else inst.name,
                          primary_host=primary.info.host if primary else "?", members=standbys,
                          synchronous=standbys, count=min(config.sync_count, max(1, len(standbys))),
                          mode=config.sync_mode)

    # -- doing -----------------------------------------------------------------------------------

    def run(self, inst: Instance, to: str | None = None, forced: bool = False,
            progress: Progress = no_progress) -> FailoverOutcome:
        """Fail `inst` over (to `to` if given). FailoverRefused when no standby is proven (and not
        `forced`); the caller holds the instance's lock."""
        refuse_several_clusters(self.fleet, inst, "fail over")
        record = self._record(inst)
        if record.failover_to is not None:
            # Resuming after a manager restart: the record already names the new primary.
            old = inst.stale[0] if inst.stale else None
            old_name = record.previous_primary
            decision = Promotion(record.failover_to, f"finishing the failover to {record.failover_to} that a "
                                                     "previous manager started", True)
        else:
            old = inst.primary
            old_name = old.name if old is not None else record.primary
            if old is not None:
                self._fence(old, progress)
            failpoint("failover.fenced")
            for guest in inst.standbys:
                self._detach(guest)
            answers = self.answers(inst)
            decision = self._decide(record, answers, to, forced)
            target = self._guest(inst, decision.candidate or "")
            record = self.fleet.sync_records.put(self._plan(record, inst, target, answers, old_name))
        failpoint("failover.recorded")
        target = self._guest(inst, decision.candidate or "")
        log.warning("%s: failing over to %s on %s: %s", inst.name, target.name, target.info.host, decision.reason)

        progress(target.name, "naming its synchronous standbys before it accepts a write", 0.3)
        with self.fleet.connect(target, timeout_s=10) as conn:
            for name in (*record.synchronous, *(g.name for g in inst.standbys if g.name != target.name)):
                replication.create_slot(conn, slot_name(name))
            replication.set_synchronous_standby_names(conn, names_for(record))
            still_standby = replication.in_recovery(conn)
        failpoint("failover.configured")

        for guest in inst.standbys:
            if guest.name != target.name and guest.info.state == "running" and guest.endpoint is not None:
                self.follow(guest, target)
        failpoint("failover.followed")

        if still_standby:
            progress(target.name, "promoting", 0.5)
            with self.fleet.connect(target, timeout_s=10) as conn:
                if not replication.promote(conn, 300):
                    raise GuestNotReady(f"{inst.name}: {target.name} did not finish promotion in 300 s")
        failpoint("failover.promoted")
        with self.fleet.connect(target, timeout_s=10) as conn:
            replication.settle_new_primary(conn)

        meta = target.info.metadata
        if meta.role != "primary":
            self.fleet.hosts[target.info.host].set_metadata(target.name, replace(meta, role="primary", standby=0))
        self.fleet.sync_records.put(record.next(failover_to=None))
        return FailoverOutcome(inst.name, old_name, target.name, target.info.host, decision.proven,
                               decision.reason, decision.may_be_missing)

    def _decide(self, record: SyncRecord, answers: list[StandbyAnswer], to: str | None, forced: bool) -> Promotion:
        if to is not None and forced:
            decision = force(record, answers, to)
        else:
            decision = decide(record, answers)
            if to is not None and decision.candidate not in (None, to):
                best = max((a.received_lsn for a in answers if a.answered), default=-1)
                if not any(a.name == to and a.answered and a.received_lsn >= best for a in answers):
                    raise FailoverRefused(f"{to} cannot be proven to hold every acknowledged commit "
                                          f"({decision.candidate} received more WAL); to promote {to} anyway, "
                                          "ask again with force")
                decision = replace(decision, candidate=to)
        if decision.candidate is None:
            raise FailoverRefused(decision.reason)
        return decision

    def _detach(self, standby: Guest) -> None:
        """Stop a standby streaming from the old primary (best effort: one that does not answer
        is not streaming from anyone we could reach either)."""
        if standby.endpoint is None or standby.info.state != "running":
            return
        try:
            with self.fleet.connect(standby, timeout_s=5) as conn:
                replication.detach(conn)
        except psycopg.Error as exc:
            log.warning("%s: could not detach it from the old primary: %s", standby.name, first_line(exc))

    def _guest(self, inst: Instance, name: str) -> Guest:
        guest = next((g for g in inst.guests if g.name == name), None)
        if guest is None or guest.endpoint is None:
            raise GuestNotReady(f"{inst.name}: {name}, chosen for the failover, is not reachable now; "
                                "the failover resumes when it is")
        return guest

    def _plan(self, record: SyncRecord, inst: Instance, target: Guest, answers: list[StandbyAnswer],
              old_name: str | None) -> SyncRecord:
        """The record after the failover: `target` primary, its synchronous standbys chosen among
        the other standbys that answered (most WAL first), then the old primary (which rejoins)."""
        others = sorted((a for a in answers if a.answered and a.in_recovery and a.name != target.name),
                        key=lambda a: -a.received_lsn)
        names = [a.name for a in others] + [g.name for g in inst.standbys
                                            if g.name != target.name and g.name not in {a.name for a in others}]
        if old_name is not None and old_name not in names:
            names.append(old_name)
        count = record.count
        chosen = tuple(names) if record.mode == "ANY" else tuple(names[:count])
        return record.next(primary=target.name, primary_host=target.info.host, members=chosen,
                           synchronous=chosen, count=min(count, max(1, len(chosen))), pending_lsn=None,
                           failover_to=target.name, previous_primary=old_name)

    def _fence(self, old: Guest, progress: Progress) -> None:
        """Power the old primary off (disk kept): it must never serve clients beside the new one."""
        if old.info.state == "unreachable" or old.info.host in self.fleet.unreachable_hosts():
            log.warning("%s: its host %s does not answer; it fences itself (no synchronous standby, no word "
                        "from the manager)", old.name, old.info.host)
            return
        progress(old.name, "fencing the old primary (powered off, disk kept)", 0.1)
        self.fleet.planned_stops.will_stop(old.name)
        try:
            self.fleet.hosts[old.info.host].stop(old.name)
        except PgcarveError as exc:
            log.warning("%s: could not power the old primary off (%s); it fences itself", old.name, exc)

    def follow(self, standby: Guest, primary: Guest) -> None:
        """Point a running standby at a (new) primary (PostgreSQL 13+ applies this on reload)."""
        if primary.address is None:
            raise GuestNotReady(f"{primary.name} has no address for {standby.name} to follow")
        with self.fleet.connect(standby, timeout_s=10) as conn:
            replication.follow(conn, primary.address, standby.name, slot_name(standby.name),
                               self.fleet.instance_secrets(standby.info.metadata.cluster).replication_password)
