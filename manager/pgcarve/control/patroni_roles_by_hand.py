"""A switchover or failover asked for by an operator, under Patroni: the manager asks the leader's
Patroni (its REST API, through this machine's way to the guest) and reports what happened. The
promotion, the demotion, fencing and the old leader's rejoining are all Patroni's.

The operation's contract stays as it was: a switchover reports `write_pause_s` (from the request
to the new leader accepting writes, an upper bound of the pause applications saw); a failover to a
member outside the synchronous set needs `force`, and then says what may be missing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg

from pgcarve.control.fleet import Fleet, Guest, Instance, Progress
from pgcarve.errors import Conflict, GuestNotReady, PatroniOutcomeUnknown
from pgcarve.naming import application_name
from pgcarve.patroni.rest import PatroniClient
from pgcarve.postgres import replication

PATRONI_PORT = 8008  # the guests' Patroni REST API (images/rootfs/usr/local/sbin/pgcarve-guest-setup)
PATRONI_USER = "pgcarve"
NEW_LEADER_TIMEOUT_S = 60

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleChange:
    result: dict[str, object]
    message: str


def patroni_api(fleet: Fleet, guest: Guest) -> PatroniClient:
    """The REST API of `guest`'s Patroni, its certificate checked against the fleet CA and the
    guest's name."""
    endpoint = fleet.endpoint_at(guest, PATRONI_PORT)
    if endpoint is None:
        raise GuestNotReady(f"{guest.name} has no address: its Patroni cannot be asked")
    password = fleet.instance_secrets(guest.info.metadata.cluster).patroni_password
    if password is None:
        raise GuestNotReady(f"no Patroni password is recorded for {guest.info.metadata.cluster}")
    host, port = endpoint
    return PatroniClient(f"https://{host}:{port}", member=guest.name, ca_file=str(fleet.paths.tls_dir / "ca.pem"),
                         username=PATRONI_USER, password=password, server_name=guest.name)


def _leader_or_refuse(inst: Instance) -> Guest:
    if inst.primary is None:
        raise Conflict(f"{inst.name} has no leader in etcd right now: Patroni elects one by itself; ask again after")
    return inst.primary


def _synchronous(fleet: Fleet, inst: Instance) -> list[str]:
    assert fleet.patroni is not None
    view = fleet.patroni.view(inst.name, fresh=True)
    return [m.replace("_", "-") for m in (view.synchronous_standbys if view is not None else ())]


def _wait_writable(fleet: Fleet, inst: Instance, old: str, progress: Progress) -> Guest:
    """The new leader, once it accepts writes."""
    assert fleet.patroni is not None
    deadline = time.monotonic() + NEW_LEADER_TIMEOUT_S
    last = "no new leader yet"
    while time.monotonic() < deadline:
        leader = fleet.patroni.leader(inst.name, fresh=True)
        if leader is not None and leader != old:
            guest = next((g for g in inst.guests if g.name == leader), None)
            if guest is not None and guest.endpoint is not None:
                try:
                    with fleet.connect(guest, timeout_s=3) as conn:
                        if not replication.in_recovery(conn):
                            return guest
                    last = f"{leader} leads but is still in recovery"
                except psycopg.Error as exc:
                    last = f"{leader}: {exc}"
        progress(inst.name, "waiting for the new leader to accept writes", 0.7)
        time.sleep(0.2)
    raise GuestNotReady(f"{inst.name}: no new leader accepted writes within {NEW_LEADER_TIMEOUT_S} s ({last}); "
                        f"Patroni's leader is {fleet.patroni.leader(inst.name) or 'nobody'}")


def _outcome_from_etcd(inst: Instance, exc: PatroniOutcomeUnknown) -> str:
    """Patroni stops waiting for a role change after its own timeout (a busy machine), not the
    change itself: the new leader is then read from etcd, as after a clear answer."""
    log.warning("%s: %s; reading the new leader from etcd instead", inst.name, exc)
    return "no answer in time; the new leader was read from etcd"


def switchover(fleet: Fleet, inst: Instance, to: str | None, progress: Progress) -> RoleChange:
    leader = _leader_or_refuse(inst)
    progress(inst.name, f"asking Patroni on {leader.name} to hand over{f' to {to}' if to else ''}", 0.2)
    started = time.monotonic()
    try:
        with patroni_api(fleet, leader) as api:
            said = api.switchover(application_name(leader.name), application_name(to) if to else None)
    except PatroniOutcomeUnknown as exc:
        said = _outcome_from_etcd(inst, exc)
    new = _wait_writable(fleet, inst, leader.name, progress)
    pause = time.monotonic() - started
    return RoleChange({"new_primary": new.name, "host": new.info.host, "write_pause_s": round(pause, 2)},
                      f"switched over from {leader.name} to {new.name} on {new.info.host}; writes paused at most "
                      f"{pause:.1f} s (Patroni: {said})")


def failover(fleet: Fleet, inst: Instance, to: str | None, forced: bool, progress: Progress) -> RoleChange:
    """Make `to` (default: a synchronous standby) the leader now. Proven: `to` is in the
    synchronous set, which strict synchronous mode keeps holding every acknowledged commit.
    Otherwise only with `forced`."""
    synchronous = _synchronous(fleet, inst)
    if to is None:
        if not synchronous:
            raise Conflict(f"{inst.name} has no synchronous standby to fail over to; name one and force it")
        to = synchronous[0]
    proven = to in synchronous
    if not proven and not forced:
        raise Conflict(f"{to} is not a synchronous standby of {inst.name} ({', '.join(synchronous) or 'none'} is): "
                       "it may lack acknowledged commits; name a synchronous one, or force the failover")
    old = inst.primary.name if inst.primary is not None else None
    asked = next((g for g in inst.guests if g.name == to), None)
    if asked is None:
        raise GuestNotReady(f"{inst.name} has no guest {to}")
    progress(inst.name, f"asking Patroni on {to} to take over", 0.2)
    try:
        with patroni_api(fleet, asked) as api:
            said = api.failover(application_name(to))
    except PatroniOutcomeUnknown as exc:
        said = _outcome_from_etcd(inst, exc)
    new = _wait_writable(fleet, inst, old or "", progress)
    missing = [] if proven else [f"commits {old or 'the old leader'} acknowledged that {to} had not received "
                                 "(it was not a synchronous standby)"]
    return RoleChange({"new_primary": new.name, "host": new.info.host, "proven": proven, "may_be_missing": missing,
                       "reason": "" if proven else "forced onto a member outside the synchronous set"},
                      f"failed over {inst.name} to {new.name} on {new.info.host} (Patroni: {said})")
