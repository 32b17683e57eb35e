"""Putting an instance back together after a fault.

The supervisor (supervisor.py) decides *when*; this module knows *how*: start a stopped guest
again from its disk, rebuild a standby that cannot come back, or fail over to the most advanced
standby. Every action keeps RPO 0 in synchronous mode: a commit was acknowledged only after a
synchronous standby had it, and failover promotes the standby that has received the most WAL.
A repair returns what it did as a RepairResult (typed steps), never as prose to be searched.
"""

from __future__ import annotations

import enum
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import psycopg

from pgcarve.config import HostConfig
from pgcarve.control.fleet import Fleet, Guest, Instance, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.removal import remove_guest
from pgcarve.errors import GuestNotReady, PgcarveError
from pgcarve.naming import instance_name, slot_name, standby_name
from pgcarve.postgres import replication

log = logging.getLogger("pgcarve.control.recovery")


class Action(enum.StrEnum):
    """What a repair step did to a guest."""

    RESTART = "restart"  # started again from its own disk
    REBUILD = "rebuild"  # removed and cloned again from the primary
    FAILOVER = "failover"  # a standby promoted in the primary's place
    NONE = "none"


@dataclass(frozen=True)
class RepairStep:
    """One thing a repair did: to which guest (its name before the repair), and in words."""

    guest: str
    action: Action
    message: str


class RepairIncomplete(PgcarveError):
    """A repair that failed after doing something (a failover, say): what, and why it stopped."""

    def __init__(self, cause: PgcarveError, steps: tuple[RepairStep, ...]):
        super().__init__(str(cause))
        self.steps = steps


@dataclass(frozen=True)
class RepairResult:
    steps: tuple[RepairStep, ...] = ()

    def for_guest(self, guest: str) -> list[RepairStep]:
        return [step for step in self.steps if step.guest == guest]

    def repaired(self, guest: str) -> bool:
        return any(step.guest == guest for step in self.steps)


class Repairer:
    """Repairs one instance at a time (the caller holds its lock: fleet.locks.exclusive)."""

    def __init__(self, fleet: Fleet, provisioner: Provisioner):
        self.fleet = fleet
        self.provisioner = provisioner

    def current(self, index: int) -> Instance | None:
        return next((i for i in self.fleet.observe() if i.index == index), None)

    # -- single guests -------------------------------------------------------------------------

    def restart(self, guest: Guest, progress: Progress = no_progress) -> Guest:
        """Start a stopped guest again from its own disk and wait until PostgreSQL answers in its
        role (a standby reconnects to its primary by itself: its slot kept the WAL it needs)."""
        host = self.fleet.config.host(guest.info.host)
        progress(guest.name, f"starting again from its disk on {host.name}", 0.2)
        self.fleet.hosts[host.name].start(guest.name)
        return self.provisioner.wait_sql(host, guest.name, progress, standby=guest.info.metadata.role == "standby")

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

    def missing_standbys(self, inst: Instance) -> list[tuple[HostConfig, str, int]]:
        """(host, name, number) for each standby the instance should have but has no guest for.

        Names and hosts come from the instance's original placement; after a failover the names
        have moved between roles, so a missing standby takes whichever name and host is free.
        """
        wanted = self.fleet.config.replication.standbys
        members = inst.guests
        numbers = {g.info.metadata.standby for g in inst.standbys}
        primary_host, standby_hosts = self.fleet.placement.hosts_for(inst.index)
        fleet_name = self.fleet.config.fleet
        slots = [(primary_host, instance_name(fleet_name, inst.index))] + [
            (h, standby_name(fleet_name, inst.index, s)) for s, h in enumerate(standby_hosts, start=1)]
        free = [(h, n) for h, n in slots
                if n not in {g.name for g in members} and h.name not in {g.info.host for g in members}]
        missing = []
        for number in range(1, wanted + 1):
            if number not in numbers and free:
                host, name = free.pop(0)
                missing.append((host, name, number))
        return missing

    # -- failover ------------------------------------------------------------------------------

    def failover(self, inst: Instance, progress: Progress = no_progress, done: list[RepairStep] | None = None,
                 why: str = "") -> Guest:
        """Promote the standby with the most WAL, fence the old primary for good, point the other
        standbys at the new primary and build a new standby where the old primary was.

        The failover is added to `done` as soon as the new primary answers, so a failure after
        that (building the replacement standby, say) still says that it failed over."""
        candidates = [g for g in inst.standbys if g.info.state == "running" and g.endpoint is not None]
        if not candidates:
            raise GuestNotReady(f"{inst.name}: no running standby to promote")
        positions: dict[str, int] = {}
        promoted: list[Guest] = []  # by an earlier attempt that failed after pg_promote
        for guest in candidates:
            try:
                with self.fleet.connect(guest, timeout_s=5) as conn:
                    recovering, position = replication.wal_position(conn)
            except psycopg.Error as exc:
                log.warning("%s: standby %s not reachable for failover: %s", inst.name, guest.name, exc)
                continue
            if recovering:
                positions[guest.name] = position
            else:
                promoted.append(guest)
        if promoted:
            # Never promote a second one: finish the failover to the one that already is.
            best = promoted[0]
            log.warning("%s: %s on %s was already promoted; finishing that failover",
                        inst.name, best.name, best.info.host)
        elif not positions:
            raise GuestNotReady(f"{inst.name}: none of its standbys answers; cannot fail over")
        else:
            best = max(candidates, key=lambda g: positions.get(g.name, -2))
            log.warning("%s: failing over to %s on %s (received WAL up to position %d)",
                        inst.name, best.name, best.info.host, positions[best.name])
        others = [g for g in inst.standbys if g.name != best.name]

        # Fence first: the old primary must never run again as a second primary.
        old = inst.primary
        if old is not None:
            progress(old.name, "fencing the old primary (removing its guest)", 0.1)
            remove_guest(self.fleet, old.info)

        if best not in promoted:
            progress(best.name, "promoting", 0.3)
            with self.fleet.connect(best, timeout_s=10) as conn:
                if not replication.promote(conn, 300):
                    raise GuestNotReady(f"{inst.name}: {best.name} did not finish promotion in 300 s")
        meta = best.info.metadata
        self.fleet.hosts[best.info.host].set_metadata(best.name, replace(meta, role="primary", standby=0))
        new_primary = self.provisioner.wait_sql(self.fleet.config.host(best.info.host), best.name, progress)
        old_name = old.name if old is not None else inst.name
        if done is not None:
            rebuilt = f"; {old_name} rebuilt as a standby" if old is not None else ""
            done.append(RepairStep(old_name, Action.FAILOVER,
                                   f"{why}failed over from {old_name} to {best.name} on {best.info.host}{rebuilt}"))

        # The replacement takes the old primary's name, host and CPUs, and the promoted
        # standby's place in the sync order.
        replacement: tuple[HostConfig, str, int] | None = None
        if old is not None:
            replacement = (self.fleet.config.host(old.info.host), old.name, meta.standby)
        order = sorted([(g.info.metadata.standby, g.name) for g in others]
                       + ([(replacement[2], replacement[1])] if replacement else []))
        sync_names = self.provisioner.sync_names([n for _, n in order])
        with self.fleet.connect(new_primary) as conn:
            for guest in others:
                replication.create_slot(conn, slot_name(guest.name))
            replication.set_synchronous_standby_names(conn, sync_names)
        for guest in others:
            if guest.info.state == "running" and guest.endpoint is not None:
                self.follow(guest, new_primary)
        if replacement is not None:
            host, name, number = replacement
            progress(name, f"building a new standby on {host.name}", 0.5)
            self.build_standby(new_primary, host, name, number, progress)
        return new_primary

    def follow(self, standby: Guest, primary: Guest) -> None:
        """Point a running standby at a new primary (PostgreSQL 13+ applies this on reload)."""
        assert primary.address is not None
        with self.fleet.connect(standby, timeout_s=10) as conn:
            replication.follow(conn, primary.address, standby.name, slot_name(standby.name),
                               self.fleet.credentials.replication_password)

    # -- whole instance ------------------------------------------------------------------------

    def repair(self, index: int, policy: str, progress: Progress = no_progress) -> RepairResult:
        """Bring instance `index` back to a running primary with all its standbys streaming.
        Returns what was done; RepairIncomplete says what was done before a step failed. Call
        with the instance held (fleet.locks.exclusive)."""
        done: list[RepairStep] = []
        try:
            return self._repair(index, policy, progress, done)
        except PgcarveError as exc:
            if done:
                raise RepairIncomplete(exc, tuple(done)) from exc
            raise

    def _repair(self, index: int, policy: str, progress: Progress, done: list[RepairStep]) -> RepairResult:
        inst = self.current(index)
        if inst is None:
            return RepairResult()
        primary = inst.primary
        old_name = primary.name if primary else inst.name
        if primary is None or primary.info.state not in ("running", "paused"):
            running_standbys = [g for g in inst.standbys if g.info.state == "running"]
            if policy == "failover" and running_standbys:
                self.failover(inst, progress, done)
            elif primary is None:
                if not running_standbys:
                    raise GuestNotReady(f"{inst.name}: no primary and no running standby; nothing to recover from")
                self.failover(inst, progress, done, why="primary guest missing: ")
            else:
                try:
                    self.restart(primary, progress)
                    done.append(RepairStep(old_name, Action.RESTART,
                                           f"restarted {primary.name} from its disk on {primary.info.host}"))
                except PgcarveError as exc:
                    if not running_standbys:
                        raise
                    log.error("%s: restarting %s failed (%s); failing over instead", inst.name, primary.name, exc)
                    self.failover(self.current(index) or inst, progress, done,
                                  why=f"could not restart {primary.name} ({exc}); ")
            inst = self.current(index)
            if inst is None or inst.primary is None:
                raise GuestNotReady(f"instance {index} has no primary after recovery")
        primary = inst.primary
        assert primary is not None
        if primary.endpoint is None:
            primary = self.provisioner.wait_sql(self.fleet.config.host(primary.info.host), primary.name, progress)

        def bring_back(guest: Guest) -> RepairStep:
            try:
                self.restart(guest, progress)
                return RepairStep(guest.name, Action.RESTART,
                                  f"restarted standby {guest.name} from its disk on {guest.info.host}")
            except PgcarveError as exc:
                log.error("%s: standby %s did not come back (%s); rebuilding it", inst.name, guest.name, exc)
                host = self.fleet.config.host(guest.info.host)
                self.rebuild_standby(primary, host, guest.name, guest.info.metadata.standby, progress)
                return RepairStep(guest.name, Action.REBUILD,
                                  f"rebuilt standby {guest.name} on {guest.info.host} (restart failed: {exc})")

        def rebuild(host: HostConfig, name: str, number: int) -> RepairStep:
            self.rebuild_standby(primary, host, name, number, progress)
            return RepairStep(name, Action.REBUILD, f"rebuilt missing standby {name} on {host.name}")

        stopped = [g for g in inst.standbys if g.info.state not in ("running", "paused")]
        missing = self.missing_standbys(inst)
        if stopped or missing:
            with ThreadPoolExecutor(max_workers=len(stopped) + len(missing)) as pool:
                futures = [pool.submit(bring_back, g) for g in stopped]
                futures += [pool.submit(rebuild, *m) for m in missing]
                errors = []
                for future in futures:
                    try:
                        done.append(future.result())
                    except PgcarveError as exc:
                        errors.append(str(exc))
                if errors:
                    raise GuestNotReady("; ".join(errors))
        final = self.current(index)
        if final is not None and final.primary is not None and final.standbys and (stopped or missing or done):
            primary_now = final.primary
            # Only running standbys: one that died meanwhile is a new fault for the next repair,
            # not a reason to fail this one after wait_streaming's timeout.
            streaming = [g.name for g in final.standbys if g.info.state == "running"]
            if primary_now.endpoint is not None and streaming:
                self.provisioner.wait_streaming(primary_now, streaming, progress)
        return RepairResult(tuple(done))
