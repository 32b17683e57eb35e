"""The HA loop: notice faults from libvirt's lifecycle events and repair the instance.

One LifecycleWatch per host reports guests that stopped or paused without the manager asking.
Each report becomes an Incident an operator can read (`GET /v1/incidents`); the instance is then
repaired by recovery.py under the instance's lock, so a repair never races a scale operation.
A periodic sweep catches what events cannot: faults while the manager or libvirtd was down,
standbys whose guest is gone entirely, a repair that failed and should be tried again.

Guests still being built by a scale operation (marked "creating") and guests this manager is
removing are not faults; the operation handles them.

Instances Terraform built are watched and repaired like the manager's own, within what the
manager may do to Terraform's guests (repair_steps.manager_may). What it may not do (build a guest)
is reported once, saying which `terraform apply` to run, and not attempted again each sweep.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import psycopg

from pgcarve.control.fleet import Fleet, Guest, Instance, Progress
from pgcarve.control.primary_watch import PrimaryWatch
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.recovery import Repairer
from pgcarve.control.repair_steps import RepairIncomplete, RepairStep, decisive
from pgcarve.control.roles_guard import guest_left_alone, left_alone
from pgcarve.errors import CapacityError, NotFound, PgcarveError
from pgcarve.postgres import replication
from pgcarve.virt.events import GuestEvent, LifecycleWatch

log = logging.getLogger("pgcarve.control.supervisor")


def repair_progress(index: int) -> Progress:
    """Each step of an HA-loop repair in the log, once per change (a repair can take minutes:
    the log says which guest it waits for, and since when)."""
    said: dict[str, str] = {}

    def progress(guest: str, step: str, _fraction: float) -> None:
        if said.get(guest) != step:
            said[guest] = step
            log.info("instance %d: %s: %s", index, guest, step)

    return progress


@dataclass
class Incident:
    id: int
    instance: str
    guest: str
    host: str
    role: str
    what: str  # e.g. "primary stopped"
    cause: str  # libvirt's reason, in words
    detected_at: float
    source: str  # "event" (libvirt lifecycle event) or "sweep" (found by the periodic check)
    status: str = "recovering"  # recovering, recovered, failed, reported
    action: str = ""
    message: str = ""
    finished_at: float | None = None
    attempts: int = 0

    def public(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Pending:
    incidents: list[Incident] = field(default_factory=list)


# Faults found by the sweep that change how an instance is repaired (control/recovery.py).
HOST_LOST = "primary host lost"
ISOLATED = "primary isolated"
REJOIN = "former primary to rejoin"


class Supervisor:
    def __init__(self, fleet: Fleet, on_change: Callable[[], None] = lambda: None, sweep_s: float | None = None,
                 retry_s: float | None = None, view: Callable[[], Sequence[Instance]] | None = None):
        """`sweep_s` and `retry_s` default to the hosts file's recovery.sweep_interval_s and
        recovery.retry_after_s."""
        self.fleet = fleet
        self.repairer = Repairer(fleet, Provisioner(fleet))
        # What the sweep looks at: the service's view (refreshed every 2 s), else libvirt itself.
        self._view = view or (lambda: fleet.observe())
        self.watch = PrimaryWatch(fleet, self._view)
        self.on_change = on_change
        self.sweep_s = fleet.config.recovery.sweep_interval_s if sweep_s is None else sweep_s
        self.retry_s = fleet.config.recovery.retry_after_s if retry_s is None else retry_s
        self.counts: dict[str, int] = {}
        self.sweeps = 0
        self.events_seen = 0  # lifecycle events taken from the watches (for tests and diagnosis)
        self._ids = itertools.count(1)
        self._incidents: deque[Incident] = deque(maxlen=500)
        self._lock = threading.Lock()
        self._events: queue.Queue[GuestEvent | None] = queue.Queue()
        self._pending: dict[int, _Pending] = {}  # instance index -> incidents awaiting repair
        self._running: set[int] = set()
        self._last_attempt: dict[int, float] = {}
        self._earlier: dict[int, list[RepairStep]] = {}  # incident id -> done by attempts that failed
        # instance index -> guests whose standby fault the last repair left to their owner (Terraform)
        self._left_to_owner: dict[int, set[str]] = {}
        self._stop = threading.Event()
        self._sweep_now = threading.Event()
        self._watches = [LifecycleWatch(h.name, h.uri, self._events.put, self._connected)
                         for h in fleet.config.hosts]
        self._thread = threading.Thread(target=self._loop, name="pgcarve-supervisor", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        for watch in self._watches:
            watch.start()
        self._thread.start()
        if self.fleet.patroni is None:  # under Patroni the synchronous set and fencing are Patroni's
            self.watch.start()

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop the loop and the event watches, waiting up to `wait_s` for each to let go of its connection."""
        self._stop.set()
        self._events.put(None)
        self.watch.stop()
        for watch in self._watches:
            watch.stop(wait_s)

    def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all(w.connected.wait(max(0.0, deadline - time.monotonic())) for w in self._watches)

    def ready(self) -> bool:
        """Watching every host's events, and the start-up sweep for faults missed while no
        manager ran is done (GET /healthz reports it)."""
        return all(w.connected.is_set() for w in self._watches) and self.sweeps > 0 and not self._sweep_now.is_set()

    def sweep_soon(self) -> None:
        """Look at the whole fleet now rather than at the next periodic sweep."""
        self._sweep_now.set()
        self._events.put(None)

    def watching(self, host: str) -> bool:
        return any(w.name == host and w.connected.is_set() for w in self._watches)

    @property
    def policy(self) -> str:
        return self.fleet.config.recovery.primary

    # -- reads -------------------------------------------------------------------------------

    def incidents(self) -> list[Incident]:
        with self._lock:
            return list(self._incidents)

    def open_incidents(self, instance: str) -> list[Incident]:
        return [i for i in self.incidents() if i.instance == instance and i.status in ("recovering", "failed")]

    # -- noticing ------------------------------------------------------------------------------

    def _connected(self, host: str, reconnect: bool) -> None:
        if reconnect:
            log.warning("host %s: lifecycle events reconnected to libvirt; checking every guest for faults "
                        "missed while disconnected", host)
        self._sweep_now.set()
        self._events.put(None)

    def _loop(self) -> None:
        next_sweep = time.monotonic()  # sweep at once: faults while no manager was running
        while not self._stop.is_set():
            try:
                event = self._events.get(timeout=max(0.05, next_sweep - time.monotonic()))
            except queue.Empty:
                event = None
            if self._stop.is_set():
                return
            if event is not None:
                self.events_seen += 1
                self._on_event(event)
            if self._sweep_now.is_set() or time.monotonic() >= next_sweep:
                self._sweep_now.clear()
                next_sweep = time.monotonic() + self.sweep_s
                try:
                    self._sweep()
                except PgcarveError as exc:
                    log.error("fault sweep could not read the fleet: %s", exc)
                self.sweeps += 1

    def _on_event(self, event: GuestEvent) -> None:
        if self.fleet.planned_stops.on_purpose(event.name):
            return
        try:
            info = self.fleet.hosts[event.host].guest(event.name)
        except NotFound:
            return  # removed (by us or by hand) or not a pgcarve guest
        except PgcarveError as exc:
            log.error("host %s: could not look up %s after a lifecycle event: %s", event.host, event.name, exc)
            return
        meta = info.metadata
        if meta.fleet != self.fleet.config.fleet or info.creating or guest_left_alone(info, self.fleet.config):
            return
        incident = self._record(meta.index, info.name, info.host, meta.role, f"{meta.role} {event.kind}",
                                event.cause, event.at, "event")
        log.error("%s %s on host %s %s: %s (detected %.0f ms after the event)", meta.role, info.name, info.host,
                  event.kind, event.cause, (time.time() - event.at) * 1000)
        if event.kind == "paused":
            self._finish([incident], "reported", "none",
                         "left paused: free space in the host's storage pool, then resume it (virsh resume)")
            return
        self._schedule(meta.index, [incident])

    def _sweep(self) -> None:
        # A repair that failed is tried again even when the sweep sees nothing wrong itself (a
        # standby that runs but does not stream, say): "will try again" must hold.
        failed = {i.instance for i in self.incidents() if i.status == "failed"}
        for inst in self._view():
            problems = self._problems(inst)
            if inst.index in self._running or self.fleet.locks.busy(inst.index):
                continue
            with self._lock:
                # Left to its owner while it lasts: a fault put right is forgotten.
                left = self._left_to_owner.pop(inst.index, set()) & {guest for guest, *_ in problems}
                if left:
                    self._left_to_owner[inst.index] = left
                pending = self._pending.get(inst.index)
                # A repair that failed waits retry_s before it is tried again, unless a host that
                # did not answer (what most repairs fail on) has answered since: then at once.
                last = self._last_attempt.get(inst.index, -1e9)
                recent = time.monotonic() - last < self.retry_s and self.fleet.host_answered_again_at < last
            if not problems and inst.name not in failed:
                continue
            if pending is not None or recent:
                continue
            # Not again for a fault already known: being repaired or failed (its guest), or reported
            # only (its guest in that role: an instance's "standby missing" carries the instance's
            # name, which is its first primary's name too).
            mine = [i for i in self.incidents() if i.instance == inst.name]
            known = {i.guest for i in mine if i.status in ("recovering", "failed")}
            reported = {(i.guest, i.role) for i in mine if i.status == "reported"}
            incidents = [self._record(inst.index, guest, host, role, what, cause, time.time(), "sweep")
                         for guest, host, role, what, cause in problems
                         if guest not in known and (guest, role) not in reported]
            still_open = self.open_incidents(inst.name)
            if not incidents and not still_open and all(role == "standby" and guest in left
                                                        for guest, _host, role, _what, _cause in problems):
                continue  # reported already, and nothing in it the manager may do: no repair loop
            self._schedule(inst.index, incidents + still_open)

    def _problems(self, inst: Instance) -> list[tuple[str, str, str, str, str]]:
        """(guest, host, role, what, cause) for each part of the instance that is not as it should be."""
        members = inst.guests
        if not members or any(g.info.creating for g in members) or left_alone(inst.roles_mismatch):
            return []
        if self.fleet.patroni is not None:
            return self._machine_problems(inst)
        timeout = self.fleet.config.recovery.host_timeout_s
        unreachable = self.fleet.unreachable_hosts()

        def lost_for(host: str) -> float:
            """Seconds the host has not answered (0.0 if it answers)."""
            return time.time() - unreachable[host][0] if host in unreachable else 0.0

        found = []
        primary = inst.primary
        record = self.fleet.sync_records.get(inst.name)
        if primary is None and record is not None and record.primary_host in unreachable:
            host = record.primary_host
            if lost_for(host) >= timeout:
                found.append((record.primary, host, "primary", HOST_LOST,
                              f"its host {host} has not answered for {lost_for(host):.0f} s"))
        elif primary is None:
            found.append((inst.name, "?", "primary", "primary missing", "no primary guest is defined"))
        elif primary.info.state == "unreachable":
            host = primary.info.host
            if lost_for(host) >= timeout and not self._logs_in(primary):
                found.append((primary.name, host, "primary", HOST_LOST,
                              f"neither libvirtd on {host} nor its PostgreSQL answered for {lost_for(host):.0f} s"))
        elif primary.info.state == "running" and (alone := self.watch.unconfirmed_for(inst.name)) >= timeout \
                and self._isolated(inst):
            found.append((primary.name, primary.info.host, "primary", ISOLATED,
                          f"no synchronous standby confirmed its commits for {alone:.0f} s while its standbys "
                          "answer the manager but receive nothing from it"))
        for guest in inst.stale:
            if guest.info.state != "unreachable" and guest.info.host not in unreachable:
                found.append((guest.name, guest.info.host, "primary", REJOIN,
                              "a failover made another guest the primary; it rejoins as a standby (rewind)"))
        for guest in (*((primary,) if primary else ()), *inst.standbys):
            if guest.info.state not in ("running", "paused", "unreachable"):
                role = guest.info.metadata.role
                found.append((guest.name, guest.info.host, role, f"{role} not running", f"state {guest.info.state}"))
        wanted = self.fleet.config.replication.standbys
        if len(inst.standbys) + len(inst.stale) < wanted:
            found.append((inst.name, "?", "standby", "standby missing",
                          f"{len(inst.standbys)} of {wanted} standby guests exist"))
        return found

    def _machine_problems(self, inst: Instance) -> list[tuple[str, str, str, str, str]]:
        """Under Patroni only machines are the manager's: guests stopped, members of a lost host
        not yet replaced elsewhere, standbys missing, replaced members whose host is back."""
        found = []
        lost = self.fleet.lost_hosts()
        wanted = self.fleet.config.replication.standbys
        present = [g for g in inst.guests if g.info.host not in lost]
        short = len(present) - 1 < wanted
        for guest in inst.guests:
            role = "primary" if guest is inst.primary else "standby"
            if guest.info.host in lost:
                if short:  # not yet replaced elsewhere
                    found.append((guest.name, guest.info.host, role, HOST_LOST,
                                  f"its host {guest.info.host} has not answered for "
                                  f"{self.fleet.config.recovery.host_timeout_s} s or more"))
            elif guest.info.state not in ("running", "paused", "unreachable"):
                found.append((guest.name, guest.info.host, role, f"{role} not running", f"state {guest.info.state}"))
            elif self.repairer.replaced(guest.name):
                found.append((guest.name, guest.info.host, role, "member replaced",
                              "its instance was made whole elsewhere while its host was lost"))
        if short and len(present) == len(inst.guests):
            found.append((inst.name, "?", "standby", "standby missing",
                          f"{len(present) - 1} of {wanted} standby guests exist"))
        return found

    def _logs_in(self, guest: Guest) -> bool:
        """Does the guest's PostgreSQL accept the manager's login (its last known address)?"""
        if guest.endpoint is None:
            return False
        try:
            with self.fleet.connect(guest, timeout_s=3):
                return True
        except (psycopg.Error, PgcarveError):
            return False

    def _isolated(self, inst: Instance) -> bool:
        """Do enough standbys answer, receiving nothing, for a failover to be proven (a primary cut
        off from its standbys), rather than the standbys being down?"""
        record = self.fleet.sync_records.get(inst.name)
        if record is None:
            return False
        cut_off = 0
        for guest in inst.standbys:
            if guest.name not in record.members or guest.endpoint is None:
                continue
            try:
                with self.fleet.connect(guest, timeout_s=3) as conn:
                    cut_off += not replication.receiving(conn)
            except (psycopg.Error, PgcarveError):
                continue
        return cut_off >= record.quorum

    # -- repairing -----------------------------------------------------------------------------

    def _record(self, index: int, guest: str, host: str, role: str, what: str, cause: str, at: float,
                source: str) -> Incident:
        name = f"{self.fleet.config.fleet}-{index:02d}"
        incident = Incident(id=next(self._ids), instance=name, guest=guest, host=host, role=role, what=what,
                            cause=cause, detected_at=at, source=source)
        with self._lock:
            self._incidents.append(incident)
            self.counts[what] = self.counts.get(what, 0) + 1
        self.on_change()
        return incident

    def _finish(self, incidents: list[Incident], status: str, action: str, message: str) -> None:
        with self._lock:
            for incident in incidents:
                incident.status, incident.action, incident.message = status, action, message
                incident.finished_at = time.time()
        self.on_change()

    def _schedule(self, index: int, incidents: list[Incident]) -> None:
        if not self.fleet.config.recovery.enabled:
            self._finish(incidents, "reported", "none", "automatic recovery is off (recovery.enabled: false)")
            return
        with self._lock:
            pending = self._pending.setdefault(index, _Pending())
            pending.incidents.extend(i for i in incidents if i not in pending.incidents)
            if index in self._running:
                return  # the running repair picks these up when it re-checks
            self._running.add(index)
        threading.Thread(target=self._repair, args=(index,), name=f"pgcarve-repair-{index}", daemon=True).start()

    def _repair(self, index: int) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    pending = self._pending.pop(index, None)
                    if pending is None:
                        return
                    self._last_attempt[index] = time.monotonic()
                incidents = pending.incidents
                for incident in incidents:
                    incident.attempts += 1
                host_lost = any(i.what == HOST_LOST for i in incidents)
                isolated = any(i.what == ISOLATED for i in incidents)
                with self.fleet.locks.exclusive(index, "recovering from a fault"):
                    try:
                        result = self.repairer.repair(index, self.policy, host_lost=host_lost, isolated=isolated,
                                                      progress=repair_progress(index))
                    except PgcarveError as exc:
                        if isinstance(exc, CapacityError):  # writable, a standby short until a host is back
                            log.warning("instance %d: not whole yet: %s (will try again)", index, exc)
                        else:
                            log.error("instance %d: recovery failed: %s (will try again)", index, exc)
                        steps = list(exc.steps) if isinstance(exc, RepairIncomplete) else []
                        for incident in incidents:  # what was done stays the incident's story
                            done = self._earlier.setdefault(incident.id, [])
                            done.extend(steps)
                            self._finish([incident], "failed", decisive(done).value if done else self.policy,
                                         "; ".join([*(step.message for step in done), f"then failed: {exc}"])
                                         if done else str(exc))
                        continue
                    except Exception as exc:  # a bug must not kill the HA loop
                        log.exception("instance %d: recovery crashed", index)
                        self._finish(incidents, "failed", self.policy, f"{type(exc).__name__}: {exc}")
                        continue
                log.warning("instance %d recovered: %s", index,
                            "; ".join(step.message for step in result.steps) or "nothing to do")
                # Faults reported while this repair ran are settled by it if it repaired their guest.
                with self._lock:
                    self._left_to_owner[index] = {step.guest for step in result.left}
                    later = self._pending.get(index)
                    settled = [i for i in (later.incidents if later else []) if result.repaired(i.guest)]
                    if later is not None:
                        later.incidents = [i for i in later.incidents if i not in settled]
                        if not later.incidents:
                            del self._pending[index]
                for incident in (*incidents, *settled):
                    # Only standbys are left to their owner (see the sweep about the names).
                    if incident.role == "standby" and (left := result.left_for(incident.guest)):
                        steps = self._earlier.pop(incident.id, []) + result.for_guest(incident.guest)
                        self._finish([incident], "reported", decisive(steps).value,
                                     "; ".join(step.message for step in (*steps, *left)))
                        continue
                    # Earlier attempts that failed half-way count too (a failover, then a retry).
                    steps = self._earlier.pop(incident.id, []) + (result.for_guest(incident.guest)
                                                                  or list(result.steps))
                    message = ("; ".join(step.message for step in steps)
                               or "nothing to do: the instance was already whole")
                    self._finish([incident], "recovered", decisive(steps).value, message)
        finally:
            with self._lock:
                self._running.discard(index)
            self.on_change()
