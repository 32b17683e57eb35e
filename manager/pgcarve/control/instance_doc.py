"""One instance's document for the API and the dashboard (GET /v1/instances), from the manager
service's cached view: libvirt's guests, the collector's replication rows and fences, the
supervisor's open incidents, and Patroni's keys when Patroni decides roles."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pgcarve.control.endpoints import instance_endpoints
from pgcarve.control.fleet import Instance
from pgcarve.control.patroni_roles import patroni_doc
from pgcarve.naming import application_name
from pgcarve.postgres.statistics import StandbyState

if TYPE_CHECKING:
    from pgcarve.control.service import ManagerService


def instance_document(service: ManagerService, inst: Instance) -> dict[str, Any]:
    """The instance as GET /v1/instances shows it: placement, state, whether commits are accepted
    and why not, its standbys, endpoints, and Patroni's view under replication.roles: patroni."""
    primary = inst.primary
    rows = {r.application_name: r for r in service.replication(inst.name)}
    standbys = []
    for guest in inst.standbys:
        # A primary lists a dead standby's walsender until wal_sender_timeout: a row counts
        # only for a running guest that is not being built again under the same name.
        row = rows.get(application_name(guest.name)) if guest.info.state == "running" else None
        if guest.info.creating:
            state, row = "building", None
        elif row and row.state:
            state = row.state
        else:
            state = "not streaming" if guest.info.state == "running" else guest.info.state
        standbys.append({
            "name": guest.name, "host": guest.info.host,
            "state": state,
            "sync_state": row.sync_state if row else None,
            "replay_lag_bytes": row.lag_bytes if row else None,
        })
    incidents = service.supervisor.open_incidents(inst.name) if service.supervisor else []
    # Not offered to clients before it is whole: being created or brought back, no DSN.
    building = service.fleet.locks.busy(inst.index) in ("creating", "reviving")
    return {
        "name": inst.name,
        "primary": primary.name if primary else None,
        "host": primary.info.host if primary else None,
        "writes": _writes(service, inst, rows),
        # An instance pgcarve leaves alone says why (control/roles_guard.py), before any incident.
        "incident": inst.roles_mismatch or (incidents[-1].what + ": " + (incidents[-1].message or incidents[-1].status)
                                            if incidents else None),
        "state": service.fleet.locks.busy(inst.index) if building else (primary.info.state if primary
                                                                      else "missing"),
        "vcpus": list(primary.host_cpus) if primary else [],
        "memory_mib": primary.info.memory_mib if primary else 0,
        "dsn": service.fleet.dsn(primary.endpoint) if primary and primary.endpoint and not building else None,
        "endpoints": asdict(endpoints) if not building and (endpoints := instance_endpoints(service.fleet, inst))
        else None,
        "standbys": standbys,
        "patroni": _patroni_doc(service, inst.name),
    }

def _patroni_doc(service: ManagerService, name: str) -> dict[str, Any] | None:
    """Patroni's view of the instance as last read (the listing just refreshed it); None when the
    manager decides roles."""
    patroni = service.fleet.patroni
    if patroni is None:
        return None
    views, _ = patroni.last_read()
    return patroni_doc(views.get(name), patroni.error)

def _writes(service: ManagerService, inst: Instance, rows: dict[str, StandbyState]) -> str:
    """Can the primary commit now? In words, for an operator."""
    primary = inst.primary
    if primary is None or primary.info.state != "running":
        return "unavailable: the primary is not running"
    doing = service.fleet.locks.busy(inst.index)
    if doing in ("creating", "reviving"):
        return f"not offered yet: {doing} (the instance is offered once all its standbys stream)"
    fence = service.collector.write_fence(inst.name) if service.collector else None
    if fence is not None:
        return (f"refused: new writes are fenced ({fence}"
                f"{', ' + doing if doing else ''}); reads are served")
    if service.config.replication.standbys == 0 or service.config.replication.synchronous_commit in ("off", "local"):
        return "accepted"
    if service.collector is None:
        return "unknown"
    error = service.collector.last_errors().get(inst.name)
    if error:
        return f"unknown: {error}"
    synced = [r for r in rows.values() if r.sync_state in ("sync", "quorum") and r.state == "streaming"]
    waiting = service.collector.commits_waiting(inst.name)
    if len(synced) >= service.config.replication.sync_count and not waiting:
        return "accepted"
    absent = service.fleet.absent_standbys(inst)
    return (f"waiting: {waiting} commit(s) wait for a synchronous standby; {len(synced)} of "
            f"{service.config.replication.sync_count} connected as sync; commits resume when one confirms (RPO 0)"
            + (f"; no guest yet for {', '.join(absent)}" if absent else ""))
