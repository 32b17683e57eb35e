"""Putting an instance back together after a fault.

The supervisor (supervisor.py) decides *when*; this module knows *how*: start a stopped guest
again from its disk, fail over (control/failover.py) where the primary's host is lost or the
policy says so, rejoin a former primary as a standby, restart or rebuild standbys, and build
missing ones on hosts that hold no member of the instance. RPO 0 throughout: failover promotes
only a standby proven to hold every acknowledged commit. A repair returns what it did as a
RepairResult (typed steps), never as prose to be searched.

Guests Terraform created (metadata created_by "terraform") are repaired too, within one rule,
`manager_may`: nothing a repair does may leave Terraform's next plan with a change to make. What
the manager may not do (build a guest) is left to Terraform, and the result says what to run.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psycopg

from pgcarve.config import HostConfig
from pgcarve.control.failover import Failover
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.patroni_roles import guest_of_member
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.removal import remove_guest
from pgcarve.control.repair_steps import (
    Action,
    RepairIncomplete,
    RepairResult,
    RepairStep,
    instance_creator,
    left_to_owner,
    manager_may,
)
from pgcarve.control.roles_guard import refuse
from pgcarve.errors import CapacityError, GuestNotReady, PgcarveError
from pgcarve.naming import standby_number
from pgcarve.postgres import replication

log = logging.getLogger("pgcarve.control.recovery")


class Repairer:
    """Repairs one instance at a time (the caller holds its lock: fleet.locks.exclusive)."""

    def __init__(self, fleet: Fleet, provisioner: Provisioner):
        self.fleet = fleet
        self.provisioner = provisioner
        self.failover = Failover(fleet, provisioner)
        # Standbys pointed at the primary again, and when: one still not receiving a while later
        # has WAL the primary never had (a forced failover), and is rewound instead.
        self._refollowed: dict[str, float] = {}
        # Under Patroni: guests of a lost host whose instance was made whole elsewhere; removed
        # when their host is back and their replacements stream. (A manager restarted meanwhile
        # knows them as the instance's surplus guests that are not running.)
        self._replaced: set[str] = set()

    def current(self, index: int) -> Instance | None:
        return self.fleet.instance_at(index)

    # -- single guests -------------------------------------------------------------------------

    def restart(self, guest: Guest, progress: Progress = no_progress) -> Guest:
        """Start a stopped guest again from its own disk and wait until PostgreSQL answers in its
        role (a standby reconnects to its primary by itself: its slot kept the WAL it needs)."""
        host = self.fleet.config.host(guest.info.host)
        progress(guest.name, f"starting again from its disk on {host.name}", 0.2)
        self.fleet.hosts[host.name].start(guest.name)
        # Under Patroni the guest takes whatever role Patroni gives it (a former leader rejoins).
        role = None if self.fleet.patroni is not None else guest.info.metadata.role == "standby"
        return self.provisioner.wait_sql(host, guest.name, progress, standby=role)

    def rebuild_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                        progress: Progress = no_progress) -> Guest:
        """Remove whatever is left of standby `name` and clone it again from the primary."""
        lv = self.fleet.hosts[host.name]
        if lv.defined(name):
            remove_guest(self.fleet, lv.guest(name))
        progress(name, f"rebuilding from {primary.name}", 0.1)
        return self.build_standby(primary, host, name, number, progress)

    def build_standby(self, primary: Guest, host: HostConfig, name: str, number: int,
                      progress: Progress = no_progress) -> Guest:
        """A new standby for a whole instance, marked complete once it replays: if the manager
        dies before that, only this standby is half-built, never the instance."""
        guest = self.provisioner.create_standby(primary, host, name, number, progress)
        self.fleet.hosts[host.name].mark_complete(name)
        return guest

    def missing_standbys(self, inst: Instance) -> tuple[list[tuple[HostConfig, str]], str]:
        """(host, name) for each standby the instance should have but has no guest for, and, when
        hosts run out, which capacity is missing (in words; "" when none is).

        A stale former primary counts as a standby (it rejoins when its host answers). A missing
        standby goes to a host of the instance's placement that answers and holds no member; names
        follow the host's slot (pgc-01 on the primary host, pgc-01-sK on standby host K), so a
        name never exists on two hosts.
        """
        wanted = self.fleet.config.replication.standbys
        need = self.standbys_short(inst)
        if not need:
            return [], ""
        unreachable = self.fleet.unreachable_hosts()
        free = [(h, n) for h, n in self.empty_slots(inst) if h.name not in unreachable]
        short = need - len(free)
        lacking = ""
        if short > 0:
            down = f" ({', '.join(sorted(unreachable))} not answering)" if unreachable else ""
            lacking = (f"{inst.name} is {short} standby(s) short of {wanted}: no host of its placement answers and "
                       f"holds none of its guests{down}; commits go on with the standbys it has, and the missing "
                       "one is built when a host is back")
        return free[:need], lacking

    def standbys_short(self, inst: Instance) -> int:
        """How many standbys the instance lacks (a stale former primary counts as one)."""
        return max(0, self.fleet.config.replication.standbys - len(inst.standbys) - len(inst.stale))

    def empty_slots(self, inst: Instance) -> list[tuple[HostConfig, str]]:
        """(host, guest name) of each slot of the instance's placement where none of its guests is."""
        slots = self.fleet.placement.guests(inst.index)
        occupied = {g.info.host for g in inst.guests}
        names = {g.name for g in inst.guests}
        return [(h, n) for h, n in slots if h.name not in occupied and n not in names]

    def missing_left_to_owner(self, inst: Instance) -> RepairStep | None:
        """For an instance whose missing standbys the manager may not build (Terraform's): what is
        missing and which hosts' `terraform apply` builds it (None when nothing is missing)."""
        need = self.standbys_short(inst)
        if not need:
            return None
        empty = self.empty_slots(inst)
        hosts = [h.name for h, _ in empty] or [h.name for h in self.fleet.placement.hosts_for(inst.index)[1]]
        have = self.fleet.config.replication.standbys - need
        what = (f"{inst.name} was built by Terraform and has {have} of its {self.fleet.config.replication.standbys} "
                f"standbys ({', '.join(n for _, n in empty) or 'a standby'} not there)")
        text = left_to_owner(what, hosts)
        down = sorted(set(hosts) & set(self.fleet.unreachable_hosts()))
        if down:
            text += (f"; not answering now: {', '.join(down)} (a standby still defined there is taken back when "
                     "its host answers)")
        return RepairStep(inst.name, Action.NONE, text)

    # -- whole instance ------------------------------------------------------------------------

    def repair(self, index: int, policy: str, host_lost: bool = False, isolated: bool = False,
               progress: Progress = no_progress) -> RepairResult:
        """Bring instance `index` back to a running primary with all its standbys streaming.

        `host_lost`: the primary's host has not answered for recovery.host_timeout_s (fail over);
        `isolated`: the primary answers but has had no synchronous standby for that long while its
        standbys answer (fail over). RepairIncomplete says what was done before a step failed.
        What the manager may not do (manager_may) is in the result's `left`, in words.
        Call with the instance held (fleet.locks.exclusive)."""
        done: list[RepairStep] = []
        try:
            return self._repair(index, policy, host_lost, isolated, progress, done)
        except PgcarveError as exc:
            if done:
                raise RepairIncomplete(exc, tuple(done)) from exc
            raise

    def _repair(self, index: int, policy: str, host_lost: bool, isolated: bool, progress: Progress,
                done: list[RepairStep]) -> RepairResult:
        inst = self.current(index)
        if inst is None:
            return RepairResult()
        refuse(inst.roles_mismatch)  # (the supervisor never asks for one: control/roles_guard.py)
        if self.fleet.patroni is not None:
            return self._repair_machines(inst, progress, done)
        record = self.fleet.sync_records.get(inst.name)
        primary = inst.primary
        if record is not None and record.failover_to is not None:
            done.append(self._fail_over(inst, progress, "a failover a previous manager started"))
        elif primary is None or primary.info.state not in ("running", "paused") or isolated:
            running_standbys = [g for g in inst.standbys if g.info.state == "running"]
            if primary is None or host_lost or isolated or primary.info.state == "unreachable":
                why = ("its host does not answer" if host_lost or primary is None or primary.info.state == "unreachable"
                       else "it has had no synchronous standby while they answer")
                done.append(self._fail_over(inst, progress, why))
            elif policy == "failover" and running_standbys:
                done.append(self._fail_over(inst, progress, "recovery.primary is failover"))
            else:
                try:
                    self.restart(primary, progress)
                    done.append(RepairStep(primary.name, Action.RESTART,
                                           f"restarted {primary.name} from its disk on {primary.info.host}"))
                except PgcarveError as exc:
                    if not running_standbys:
                        raise
                    log.error("%s: restarting %s failed (%s); failing over instead", inst.name, primary.name, exc)
                    done.append(self._fail_over(self.current(index) or inst, progress,
                                                f"it could not be restarted ({exc})"))
        inst = self.current(index)
        if inst is None or inst.primary is None:
            raise GuestNotReady(f"instance {index} has no primary after recovery")
        primary = inst.primary
        if primary.endpoint is None:
            primary = self.provisioner.wait_sql(self.fleet.config.host(primary.info.host), primary.name, progress)
        elif self._streams_from_another(primary):
            # Rejoining "former primaries" onto it would stop the server that really is the primary.
            raise GuestNotReady(f"{inst.name}: its synchronous-set record names {primary.name} as the primary, but "
                                f"{primary.name} streams from another server: the record predates the instance's "
                                "guests (made again?); nothing is rejoined or rebuilt until it is removed "
                                f"({self.fleet.sync_records.directory / (inst.name + '.json')})")
        left: list[RepairStep] = []
        with self.fleet.locks.welcome_keeper(index):  # the primary stays: the sync set may be kept
            done += self._mend_standbys(inst, primary, progress, left)
            final = self.current(index)
            if final is not None and final.primary is not None and final.standbys and done:
                primary_now = final.primary
                streaming = [g.name for g in final.standbys if g.info.state == "running"]
                if primary_now.endpoint is not None and streaming:
                    self.provisioner.wait_streaming(primary_now, streaming, progress)
        for step in left:
            log.warning("%s: left to its owner: %s", inst.name, step.message)
        return RepairResult(tuple(done), tuple(left))

    def _repair_machines(self, inst: Instance, progress: Progress, done: list[RepairStep]) -> RepairResult:
        """Under Patroni the manager repairs machines, never roles.

        - A guest that stopped is started again from its disk (Patroni makes it a replica,
          rewinding a former leader), unless its instance was made whole without it while its host
          was lost: then it is removed, once the members that replaced it stream. Such a guest is
          never started, so a former leader coming back never leads.
        - A member whose host has not answered for recovery.host_timeout_s is replaced on a host
          that answers and holds none of the instance's guests; Patroni clones the new member from
          a replica (every member carries Patroni's clonefrom tag), from the leader only when no
          replica runs.
        - A missing standby is built in its planned slot.
        A guest on a host that does not answer is otherwise left alone: Patroni has already moved
        the leader if it had to."""
        unreachable = self.fleet.unreachable_hosts()
        lost = self.fleet.lost_hosts()
        wanted = 1 + self.fleet.config.replication.standbys
        surplus = len(inst.guests) - wanted
        for guest in inst.guests:
            if guest.info.host in unreachable:
                continue
            replaced = surplus > 0 and manager_may(Action.REMOVE, guest.info.metadata.created_by) and (
                guest.info.state not in ("running", "paused") or guest.name in self._replaced)
            if replaced:
                if self._whole_without(inst, guest):
                    remove_guest(self.fleet, guest.info)
                    self._replaced.discard(guest.name)
                    surplus -= 1
                    done.append(RepairStep(guest.name, Action.REMOVE,
                                           f"removed {guest.name} from {guest.info.host} (its disk too): "
                                           f"{inst.name} was made whole on other hosts while {guest.info.host} was "
                                           "lost, and those members stream"))
                else:
                    log.info("%s: %s stays stopped until the members that replaced it stream", inst.name, guest.name)
                continue
            if guest.info.state in ("running", "paused", "unreachable"):
                continue
            self.restart(guest, progress)
            done.append(RepairStep(guest.name, Action.RESTART,
                                   f"started {guest.name} again from its disk on {guest.info.host}; Patroni gives it "
                                   "its role"))
        inst = self.current(inst.index) or inst
        present = [g for g in inst.guests if g.info.host not in lost]
        need = wanted - len(present)
        if need <= 0:
            return RepairResult(tuple(done))
        if inst.primary is None:
            raise GuestNotReady(f"{inst.name} has no leader in etcd yet: its missing members are built once Patroni "
                                "elects one")
        spares = self.fleet.placement.spares(inst.index, {g.info.host for g in inst.guests})
        free = [(h, n) for h, n in (*self.empty_slots(inst), *spares) if h.name not in unreachable]
        if not manager_may(Action.REBUILD, instance_creator(inst)):
            names = [n for _, n in free[:need]] or ["a member"]
            step = RepairStep(inst.name, Action.NONE, left_to_owner(f"{inst.name} lacks {', '.join(names)}",
                                                                    [h.name for h, _ in free[:need]] or lost))
            return RepairResult(tuple(done), (step,))
        used = {g.info.metadata.standby for g in inst.guests}
        gone = [g.name for g in inst.guests if g.info.host in lost]
        why = f" in place of {', '.join(gone)} (host {', '.join(lost)} lost)" if gone else ""
        for host, name in free[:need]:
            # A planned primary's slot taken again by a new member keeps its name: it joins as a
            # standby whose number no guest of the instance uses.
            number = standby_number(name) if name != inst.name else next(n for n in itertools.count(
                self.fleet.config.replication.standbys + 1) if n not in used)
            used.add(number)
            self.build_standby(inst.primary, host, name, number, progress)
            self._replaced.update(gone)
            done.append(RepairStep(name, Action.REBUILD, f"built {name} on {host.name}{why}; Patroni cloned it"))
        if need > len(free):
            down = f" ({', '.join(sorted(unreachable))} not answering)" if unreachable else ""
            lacking = (f"{inst.name} is {need - len(free)} member(s) short: no host answers and holds none of its "
                       f"guests{down}; commits go on with the members it has, and the missing one is built when "
                       "a host is back")
            if not done:
                raise CapacityError(lacking)
            log.warning("%s", lacking)
        return RepairResult(tuple(done))

    def replaced(self, guest: str) -> bool:
        """Was `guest` replaced on another host while its own was lost?"""
        return guest in self._replaced

    def _whole_without(self, inst: Instance, guest: Guest) -> bool:
        """Does Patroni show the instance with a leader and all its standbys streaming, `guest`
        aside?"""
        assert self.fleet.patroni is not None
        view = self.fleet.patroni.view(inst.name, fresh=True)
        if view is None or view.leader is None or guest_of_member(view.leader) == guest.name:
            return False
        streaming = [m for m in view.members if m.name != view.leader and m.replication_state == "streaming"
                     and guest_of_member(m.name) != guest.name]
        return len(streaming) >= self.fleet.config.replication.standbys

    def _fail_over(self, inst: Instance, progress: Progress, why: str) -> RepairStep:
        old = inst.primary.name if inst.primary else inst.name
        outcome = self.failover.run(inst, progress=progress)
        return RepairStep(outcome.old_primary or old, Action.FAILOVER, f"{outcome.message}: {why}")

    def _mend_standbys(self, inst: Instance, primary: Guest, progress: Progress,
                       left: list[RepairStep]) -> list[RepairStep]:
        """Rejoin former primaries, restart or rebuild stopped standbys, point detached ones at the
        primary, build missing ones; all at once. A rebuild or build the manager may not do
        (manager_may) goes to `left` instead, saying what the operator should run."""
        unreachable = self.fleet.unreachable_hosts()
        # Standby numbers (sync priority order) not taken, for rejoined and rebuilt standbys alike.
        used = {g.info.metadata.standby for g in inst.standbys}
        numbers = iter(n for n in range(1, len(inst.guests) + self.fleet.config.replication.standbys + 1)
                       if n not in used)

        def rejoin(guest: Guest, number: int) -> RepairStep:
            self.provisioner.rejoin(guest, primary, number, progress)
            return RepairStep(guest.name, Action.REJOIN, f"{guest.name}, the former primary, rejoined as a standby "
                                                         f"of {primary.name} (rewound, its disk kept)")

        def bring_back(guest: Guest) -> RepairStep:
            try:
                restarted = self.restart(guest, progress)
            except PgcarveError as exc:
                if not manager_may(Action.REBUILD, guest.info.metadata.created_by):
                    log.error("%s: standby %s did not come back (%s); it is not the manager's to rebuild",
                              inst.name, guest.name, exc)
                    return RepairStep(guest.name, Action.NONE, left_to_owner(
                        f"{guest.name} was created by Terraform and cannot be started again from its disk ({exc})",
                        [guest.info.host], damaged=True))
                log.error("%s: standby %s did not come back (%s); rebuilding it", inst.name, guest.name, exc)
                host = self.fleet.config.host(guest.info.host)
                self.rebuild_standby(primary, host, guest.name, guest.info.metadata.standby, progress)
                return RepairStep(guest.name, Action.REBUILD,
                                  f"rebuilt standby {guest.name} on {guest.info.host} (restart failed: {exc})")
            # A failover while it was down left it following a primary that is gone: point it at
            # this one now (a no-op when it already does), or the wait for streaming below waits
            # out its whole timeout. If it cannot follow, the next sweep rewinds it after the grace.
            try:
                self.failover.follow(restarted, primary)
            except psycopg.Error as exc:
                raise GuestNotReady(f"{guest.name} restarted but could not be pointed at {primary.name}: "
                                    f"{exc}") from exc
            self._refollowed[guest.name] = time.monotonic()
            return RepairStep(guest.name, Action.RESTART,
                              f"restarted standby {guest.name} from its disk on {guest.info.host}")

        def rebuild(host: HostConfig, name: str, number: int) -> RepairStep:
            self.rebuild_standby(primary, host, name, number, progress)
            return RepairStep(name, Action.REBUILD, f"rebuilt missing standby {name} on {host.name}")

        def refollow(guest: Guest) -> RepairStep:
            self.failover.follow(guest, primary)
            self._refollowed[guest.name] = time.monotonic()
            return RepairStep(guest.name, Action.FOLLOW, f"{guest.name} follows {primary.name} again")

        def rewind(guest: Guest, number: int) -> RepairStep:
            self.provisioner.rejoin(guest, primary, number, progress)
            self._refollowed.pop(guest.name, None)
            return RepairStep(guest.name, Action.REJOIN, f"{guest.name} could not follow {primary.name} (its WAL "
                                                         "went past where the two diverged); rewound onto it")

        work: list[tuple[Callable[..., RepairStep], tuple[object, ...]]] = []
        for guest in inst.stale:
            if guest.info.host not in unreachable and guest.info.state != "unreachable":
                work.append((rejoin, (guest, next(numbers))))
        for guest in inst.standbys:
            if guest.info.state in ("running", "paused", "unreachable") or guest.info.host in unreachable:
                continue
            work.append((bring_back, (guest,)))
        detached = self._detached(inst, primary)
        for guest in inst.standbys:
            if guest not in detached:
                self._refollowed.pop(guest.name, None)  # it receives: nothing to remember
        for guest in detached:
            followed_at = self._refollowed.get(guest.name)
            if followed_at is None:
                work.append((refollow, (guest,)))
            elif time.monotonic() - followed_at > self.fleet.config.recovery.refollow_grace_s:
                work.append((rewind, (guest, guest.info.metadata.standby)))
        lacking = ""
        if manager_may(Action.REBUILD, instance_creator(inst)):
            missing, lacking = self.missing_standbys(inst)
            work += [(rebuild, (host, name, next(numbers))) for host, name in missing]
            if lacking:
                log.warning("%s", lacking)
        elif (unbuilt := self.missing_left_to_owner(inst)) is not None:
            left.append(unbuilt)
        steps: list[RepairStep] = []
        if work:
            with ThreadPoolExecutor(max_workers=len(work)) as pool:
                futures = [pool.submit(fn, *args) for fn, args in work]
                errors = []
                for future in futures:
                    try:
                        step = future.result()
                    except PgcarveError as exc:
                        errors.append(str(exc))
                        continue
                    (left if step.action == Action.NONE else steps).append(step)
                if errors:
                    raise GuestNotReady("; ".join(errors))
        if lacking and not steps:
            raise CapacityError(lacking)
        return steps

    def _streams_from_another(self, guest: Guest) -> bool:
        """Is `guest` a standby streaming from some other server now? (False when it cannot be asked.)"""
        try:
            with self.fleet.connect(guest, timeout_s=3) as conn:
                return replication.in_recovery(conn) and replication.receiving(conn)
        except (psycopg.Error, PgcarveError):
            return False

    def _detached(self, inst: Instance, primary: Guest) -> list[Guest]:
        """Running standbys that stream from nobody (detached by a failover that was refused, or
        following a primary that is gone): they should follow the current primary."""
        found = []
        for guest in inst.standbys:
            if guest.info.state != "running" or guest.endpoint is None:
                continue
            try:
                with self.fleet.connect(guest, timeout_s=3) as conn:
                    receiving = replication.receiving(conn)
            except psycopg.Error:
                continue
            if not receiving:
                found.append(guest)
        return found
