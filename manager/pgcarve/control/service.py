"""The manager as a long-running service: what the REST API and the dashboard talk to.

Holds the fleet, the scale operation queue, a cached view of the instances (refreshed in the
background and after every operation, so reads never wait on libvirt or PostgreSQL) and the
TPS collector. Raises pgcarve errors only; the API maps them to HTTP statuses in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from pgcarve.config import FleetConfig
from pgcarve.control.backups import Backups
from pgcarve.control.boot_watch import REBUILDING
from pgcarve.control.capacity import check_capacity
from pgcarve.control.collector import Collector, Target
from pgcarve.control.fleet import Fleet, Instance, Progress
from pgcarve.control.fleet_view import FleetView
from pgcarve.control.instance_doc import instance_document
from pgcarve.control.leadership import Leadership
from pgcarve.control.listing import Listing
from pgcarve.control.operations import Operation, OperationQueue
from pgcarve.control.rates import RateTracker, Snapshot
from pgcarve.control.removal import discard_half_made
from pgcarve.control.retired import retired_doc, retired_instances
from pgcarve.control.retirement import finish_interrupted, purge
from pgcarve.control.role_changes import run_role_change
from pgcarve.control.roles_guard import refuse
from pgcarve.control.scaler import Scaler
from pgcarve.control.supervisor import Incident, Supervisor
from pgcarve.control.switchover import Switchover
from pgcarve.control.terms import Terms
from pgcarve.control.waits import WaitBreakdown, WaitSampler, breakdown_of
from pgcarve.errors import ConfigError, Conflict, NotFound, PgcarveError
from pgcarve.planning.planner import explain, plan_host, plan_to_dict
from pgcarve.postgres.conninfo import admin_conninfo
from pgcarve.postgres.session import APP_DATABASE, APP_USER
from pgcarve.postgres.statistics import StandbyState
from pgcarve.settings import Paths
from pgcarve.virt.events import start_event_loop

log = logging.getLogger("pgcarve.control.service")

# How long the API keeps sampling an instance's pg_stat_activity after the last request for what
# its commits wait on (GET /v1/instances/{name}/waits; the dashboard asks every 2 s while open).
WAITS_ON_DEMAND_S = 120.0
# How long the collector waits for a primary's answer to its statistics query.
STATS_QUERY_TIMEOUT_S = 10.0


class ManagerService:
    def __init__(self, config: FleetConfig, paths: Paths, refresh_s: float = 2.0, collect: bool = True,
                 collect_interval_s: float = 1.0, supervise: bool = True, boot_timeout_s: float = 600.0,
                 waits_hz: float = 5.0, leadership: Leadership | None = None):
        """`waits_hz`: how often each primary's client sessions are sampled for what they wait on
        (control/waits.py; 0: never). Nothing is polled unless `collect`. `leadership`: control/terms.py."""
        self.config = config
        self.paths = paths
        self.leadership = leadership
        self.fleet = Fleet(config, paths, boot_timeout_s=boot_timeout_s)
        self.scaler = Scaler(self.fleet)
        paths.state_dir.mkdir(parents=True, exist_ok=True)
        self.operations = OperationQueue(self._run_operation, journal=paths.state_dir / "operations.json")
        self.backups = Backups(self.fleet, self.operations)  # runs the queue's "backup" operations
        self.tracker = RateTracker(history_seconds=3600)
        # A primary busy under load (seconds under emulation) still gives its sample late, where a
        # 3 s limit dropped the session and a new one cost more. Rounds do not wait for a slow
        # poll (round_timeout_s), and connecting keeps its 3 s.
        self.collector = (Collector(self._targets, self.tracker, interval_s=collect_interval_s,
                                    query_timeout_s=STATS_QUERY_TIMEOUT_S) if collect else None)
        # Sampled only while someone looks (the dashboard asks every 2 s): WAITS_ON_DEMAND_S.
        self.waits = (WaitSampler(self._targets, rate_hz=waits_hz, on_demand_s=WAITS_ON_DEMAND_S)
                      if collect and waits_hz > 0 else None)
        self.refresh_s = refresh_s
        self._view = FleetView(instances=(), observed_at=0.0)
        self._view_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._listing = Listing(self._docs_key, self._build_docs)
        self._refresh_wanted = threading.Event()
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="pgcarve-refresh", daemon=True)
        self._scale_lock = threading.Lock()
        self.supervise, self.supervisor_started = supervise, False  # (a new HA loop per term: control/terms.py)
        self.supervisor = self.new_supervisor() if supervise else None

    def new_supervisor(self) -> Supervisor:
        return Supervisor(self.fleet, on_change=self._refresh_wanted.set, view=lambda: self.view.instances)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.supervisor is not None:
            start_event_loop()  # before any connection, so every connection notices a restarted libvirtd
        if self.leadership is not None:  # reads at once; acting once elected (control/terms.py)
            Terms(self).begin(self._refresher)
            return
        try:
            for what in finish_interrupted(self.fleet):
                log.warning("%s, left half-way by a manager that stopped in the middle of an operation", what)
            for what in discard_half_made(self.fleet):
                log.warning("removed %s, left by a manager that stopped in the middle of an operation", what)
        except PgcarveError as exc:
            log.error("could not check for half-made instances: %s", exc)
        self.refresh()
        resumed = self.operations.start()
        for op in resumed:
            log.warning("resuming operation %s (scale to %d) left unfinished by a previous manager", op.id, op.target)
        self._refresher.start()
        if self.supervisor is not None:
            self.supervisor.start()

    def stop(self) -> None:
        self._stop.set()
        if self.supervisor is not None:
            self.supervisor.stop()
        self._refresh_wanted.set()
        self.operations.stop()
        if self.leadership is not None:
            self.leadership.stop()  # a leader hands over at once rather than after its lease
        self.fleet.close()

    async def run_collector(self, stop: asyncio.Event) -> None:
        if self.collector is None:
            return
        try:
            # A task group, not gather: if one of them fails, the other is cancelled and awaited
            # before the connections are closed under it.
            async with asyncio.TaskGroup() as group:
                group.create_task(self.collector.run(stop))
                if self.waits is not None:
                    group.create_task(self.waits.run(stop))
        finally:
            await self.collector.aclose()

    # -- view --------------------------------------------------------------------------------

    def refresh(self) -> FleetView:
        # One observation at a time: the refresher and an operation's end both refresh, and a
        # slower observation begun earlier must not replace a newer one (a scale-down's removed
        # instances would briefly come back).
        with self._refresh_lock:
            busy = self.fleet.locks.all_busy()  # before observing: at worst older than what is seen
            try:
                view = FleetView(instances=tuple(self.fleet.observe()), observed_at=time.time(),
                                 retired=tuple(retired_instances(self.fleet)), busy=busy)
            except PgcarveError as exc:
                log.error("could not observe the fleet: %s", exc)
                with self._view_lock:
                    view = FleetView(self._view.instances, self._view.observed_at, error=str(exc),
                                     retired=self._view.retired, busy=busy)
            with self._view_lock:
                old = self._view
                if view.content() == old.content():  # nothing changed: the documents serve on
                    view = replace(old, observed_at=view.observed_at)
                self._view = view
            return view

    def _refresh_loop(self) -> None:
        while not self._stop.is_set():
            self._refresh_wanted.wait(self.refresh_s)
            self._refresh_wanted.clear()
            if not self._stop.is_set():
                self.refresh()
                with contextlib.suppress(Exception):  # (a request builds them again, and says why)
                    self._listing.build_read()

    @property
    def view(self) -> FleetView:
        with self._view_lock:
            return self._view

    def _targets(self) -> list[Target]:
        password, tls = self.fleet.credentials.admin_password, self.fleet.client_tls
        targets = []
        for inst in self.view.instances:
            guest = inst.primary
            if guest is not None and guest.endpoint is not None:
                host, port = guest.endpoint
                targets.append(Target(instance=inst.name, host=guest.info.host,
                                      dsn=admin_conninfo(host, port, password, tls)))
        return targets

    # -- reads -------------------------------------------------------------------------------

    def hosts(self) -> list[dict[str, Any]]:
        guests_by_host: dict[str, list[tuple[int, ...]]] = {h.name: [] for h in self.config.hosts}
        for inst in self.view.instances:
            for guest in (*((inst.primary,) if inst.primary else ()), *inst.standbys):
                guests_by_host.setdefault(guest.info.host, []).append(guest.host_cpus)
        result = []
        for host in self.config.hosts:
            topo = self.fleet.topology(host.name)
            used = {c for cpus in guests_by_host[host.name] for c in cpus}
            result.append({
                "name": host.name, "uri": host.uri, "role": host.role, "cpus": topo.cpu_count,
                "numa_nodes": len(topo.nodes), "memory_mib": topo.memory_mib,
                "free_cpus": topo.cpu_count - len(used), "instances": len(guests_by_host[host.name]),
                "watching_events": self.supervisor.watching(host.name) if self.supervisor else None,
            })
        return result

    def replication(self, instance: str) -> list[StandbyState]:
        return self.collector.replication(instance) if self.collector else []

    def instance_docs(self, include_retired: bool = False) -> list[dict[str, Any]]:
        """Every instance's document (retired ones too if asked), built again when a view
        refresh finds a change (in libvirt, the retired disks, or the work holding instances),
        an incident, or a collector round (about every second while collecting, whether or not it
        changed anything) may have changed them, and shared by every read in between: the same
        list object until then, so callers may cache what they derive from it. After each
        refresh the refresher builds those read since (control/listing.py), not a request.

        Building may read files (sandbox forwards) and wait on locks: call it from a worker
        thread, never from the event loop the collector and the wait sampler run on."""
        return self._listing.get(include_retired)

    def _build_docs(self, include_retired: bool) -> list[dict[str, Any]]:
        view = self.view
        docs = [instance_document(self, inst) for inst in view.instances]
        if include_retired:
            docs = sorted(docs + [retired_doc(r) for r in view.retired], key=lambda d: str(d["name"]))
        return docs

    def _docs_key(self) -> tuple[object, ...]:
        incidents = self.supervisor.incidents() if self.supervisor else []
        return (self.view.content(), self.collector.rounds if self.collector else None,
                tuple((i.id, i.status, i.message) for i in incidents))

    def instance_doc(self, name: str) -> dict[str, Any]:
        view = self.view
        for inst in view.instances:
            if inst.name == name:
                return instance_document(self, inst)
        for retired in view.retired:
            if retired.name == name:
                return retired_doc(retired)
        raise NotFound(f"no instance named {name!r}")

    def instance_credentials(self, name: str) -> dict[str, str]:
        """The instance's application login: {user, password, database}."""
        self.instance_doc(name)  # NotFound for an instance that does not exist
        secrets = self.fleet.instance_secrets(name)
        return {"user": APP_USER, "password": secrets.app_password, "database": APP_DATABASE}

    def instance_waits(self, name: str) -> WaitBreakdown:
        """What the instance's client sessions waited on over the sampler's window."""
        if not any(inst.name == name for inst in self.view.instances):
            raise NotFound(f"no instance named {name!r}")
        found = self.waits.breakdown(name) if self.waits else None
        if found is not None:
            return found
        if self.waits is None:
            why = "PGCARVE_WAITS_HZ=0" if self.collector is not None else "PGCARVE_COLLECT=0: nothing is polled"
            return breakdown_of(name, [], 0.0, error=f"sampling is off ({why})")
        if any(t.instance == name for t in self._targets()):
            return breakdown_of(name, [], self.waits.window_s,
                                error=f"not sampled yet: sampling starts now and goes on while it is asked for "
                                      f"(stops {WAITS_ON_DEMAND_S:.0f} s after the last request)")
        return breakdown_of(name, [], self.waits.window_s, error="the primary has no address yet")

    def incidents(self) -> list[Incident]:
        return self.supervisor.incidents() if self.supervisor else []

    def plan(self, instances: int) -> list[dict[str, Any]]:
        if instances < 0:
            raise ConfigError(f"instances must be >= 0, not {instances}")
        docs = []
        for host in self.config.hosts:
            topo = self.fleet.topology(host.name)
            plan = plan_host(topo, self.fleet.placement.planner, instances)
            docs.append({"host": host.name, "role": host.role, **plan_to_dict(plan),
                         "explanation": explain(plan, topo, self.fleet.placement.planner)})
        return docs

    def snapshot(self) -> Snapshot:
        return self.tracker.snapshot()

    def latest(self) -> Snapshot:
        """The last recorded poll (the same points /v1/tps/history returns), else a fresh snapshot."""
        recent = self.tracker.history(5)
        return recent[-1] if recent else self.tracker.snapshot()

    # -- scaling -----------------------------------------------------------------------------

    def request_scale(self, instances: int) -> Operation:
        """Validate and queue a scale; raises (and changes nothing) if it can never succeed."""
        check_capacity(self.fleet, instances)
        return self.operations.submit("scale", instances)

    def purge(self, name: str, confirm: str | None) -> dict[str, Any]:
        """Delete a retired instance's disks for good; `confirm` must repeat its name."""
        if confirm != name:
            raise ConfigError(f"purging deletes {name}'s database for good: repeat its name to confirm "
                              f"(?confirm={name})")
        busy = self.operations.active()
        if busy:
            raise Conflict(f"operation {busy[0].id} ({busy[0].kind}) is {busy[0].status}; purge when it has finished")
        retired = purge(self.fleet, name)
        self.refresh()
        return {"name": retired.name, "purged_mib": retired.disk_mib,
                "volumes": [f"{g.name} on {g.host}" for g in retired.guests]}

    def _instance(self, name: str) -> Instance:
        """Instance `name` to change by hand: NotFound, or RolesMismatch for one pgcarve does not act on."""
        inst = next((i for i in self.view.instances if i.name == name), None)
        if inst is None:
            raise NotFound(f"no instance named {name!r}")
        refuse(inst.roles_mismatch)
        return inst

    def request_failover(self, name: str, to: str | None, forced: bool) -> Operation:
        """Queue a failover by hand: to `to`, only if proven to hold every acknowledged commit
        unless `forced` (then the operation's result says what may be missing)."""
        inst = self._instance(name)
        if forced and to is None:
            raise ConfigError('a forced failover needs the standby to promote: {"to": "<standby>", "force": true}')
        if to is not None and to not in {g.name for g in inst.standbys}:
            raise NotFound(f"{name} has no standby {to!r} (standbys: {', '.join(g.name for g in inst.standbys)})")
        return self.operations.submit("failover", inst.index, {"instance": name, "to": to, "force": forced})

    def request_switchover(self, name: str, to: str | None) -> Operation:
        """Queue a planned switchover to `to` (default: the synchronous standby)."""
        inst = self._instance(name)
        if self.fleet.patroni is not None:  # Patroni picks a synchronous standby when none is named
            if to is not None and to not in {g.name for g in inst.standbys}:
                raise NotFound(f"{name} has no standby {to!r} (standbys: {', '.join(g.name for g in inst.standbys)})")
            return self.operations.submit("switchover", inst.index, {"instance": name, "to": to})
        target = Switchover(self.fleet, self.scaler.provisioner).target_of(inst, to)
        return self.operations.submit("switchover", inst.index, {"instance": name, "to": target.name})

    def _run_operation(self, op: Operation) -> str | None:
        """Run one queued operation; returns what it did, in words, for the operation's message."""
        lock = threading.Lock()

        def progress(name: str, step: str, fraction: float) -> None:
            with lock:
                steps = dict(op.steps)
                # A guest's stuck boots stay in its entry after the step has moved on.
                earlier = steps.get(name, {}).get("stuck", [])
                stuck = [*(earlier if isinstance(earlier, list) else [])]
                if step.startswith(REBUILDING):
                    stuck.append(step)
                steps[name] = {"step": step, "fraction": round(fraction, 3), **({"stuck": stuck} if stuck else {})}
                fractions = [float(str(s["fraction"])) for s in steps.values()]
                overall = sum(fractions) / max(1, len(fractions))
                self.operations.update(op, steps=steps, progress=round(min(0.99, overall), 3),
                                       message=f"{name}: {step}")

        try:
            if op.kind == "scale":
                plan = self.scaler.scale(op.target, progress)
                return (f"created {len(plan.create)}, brought back {len(plan.revive)} from retirement, "
                        f"retired {len(plan.retire)} (disks kept)")
            return self._run_role_change(op, progress)
        finally:
            self.refresh()
            self._refresh_wanted.set()
            if self.supervisor is not None:
                self.supervisor.sweep_soon()  # a former primary to rejoin, standbys to mend

    def _run_role_change(self, op: Operation, progress: Progress) -> str:
        """A failover or switchover by hand, holding the instance like a repair does; returns
        what was done, in words."""
        name, to = str(op.params["instance"]), op.params.get("to")
        provisioner = self.scaler.provisioner
        with self.fleet.locks.exclusive(op.target, f"{op.kind} by hand"):
            inst = self.fleet.instance(name)
            if to is not None and inst.primary is not None and inst.primary.name == to:
                self.operations.update(op, result={"new_primary": to})
                return f"{to} is already the primary of {name}"
            change = run_role_change(self.fleet, provisioner, inst, op.kind, str(to) if to else None,
                                     bool(op.params.get("force")), progress)
        self.operations.update(op, result=change.result)
        return change.message

    def wait_idle(self, timeout_s: float) -> bool:
        return self.operations.wait_idle(timeout_s)


def close_quietly(service: ManagerService) -> None:
    with contextlib.suppress(Exception):
        service.stop()
