"""Who may replicate from whom: every guest of an instance lets the replication role in only
from the other guests of the same instance (its standbys now; after a promotion, its siblings).

Addresses come from DHCP, so a new standby's address is known only once it has booted, and its
first clone (pg_basebackup, retried by the guest) waits until its primary lets it in. The
provisioner calls `refresh_replication_access` as soon as a standby it waits for has an address:
a new or rebuilt standby, or one started again (its address may have changed). The SQL is
postgres/hba.py's `allow_standbys`, which a failover may also call on a promoted guest directly.
"""

from __future__ import annotations

import logging
import threading

import psycopg

from pgcarve.control.fleet import Fleet
from pgcarve.errors import GuestNotReady, NotFound, PgcarveError
from pgcarve.postgres import hba
from pgcarve.postgres.session import first_line

log = logging.getLogger("pgcarve.control.access")

_guard = threading.Lock()
_instance_locks: dict[str, threading.Lock] = {}


def _lock(instance: str) -> threading.Lock:
    """One refresh of an instance at a time, so the last one written is from the newest view
    (two standbys built in parallel each refresh as they get their address)."""
    with _guard:
        return _instance_locks.setdefault(instance, threading.Lock())


def refresh_replication_access(fleet: Fleet, index: int) -> dict[str, list[str]]:
    """On every running guest of instance `index`, allow replication from exactly the addresses
    of its other guests (running or not: a stopped guest keeps its lease); returns, per guest
    updated, the addresses it now allows. A standby that does not answer is skipped (it is
    refreshed when it comes back); GuestNotReady if the primary could not be updated."""
    inst = fleet.instance_at(index)
    if inst is None:
        raise NotFound(f"no instance with index {index}")
    with _lock(inst.name):
        inst = fleet.instance_at(index) or inst
        addresses = {g.name: g.address or fleet.last_address(g.info) for g in inst.guests}
        updated: dict[str, list[str]] = {}
        for guest in inst.guests:
            if guest.endpoint is None:
                continue
            others = [address for name, address in addresses.items() if name != guest.name and address]
            try:
                with fleet.connect(guest, timeout_s=5) as conn:
                    updated[guest.name] = hba.allow_standbys(conn, others)
            except (psycopg.Error, PgcarveError) as exc:
                problem = first_line(exc)
                if inst.primary is not None and guest.name == inst.primary.name:
                    raise GuestNotReady(f"{inst.name}: could not let its standbys replicate from "
                                        f"{guest.name}: {problem}") from exc
                log.info("%s: %s not updated for replication access (%s); it is when it comes back",
                         inst.name, guest.name, problem)
        for name, allowed in updated.items():
            log.info("%s: %s accepts replication from %s", inst.name, name, ", ".join(allowed) or "nobody")
        return updated
