"""Several managers, one acting: the fleet's leadership lease in etcd.

Every `pgcarve serve` of a fleet whose hosts file has an `etcd:` section campaigns for one key,
/pgcarve/<fleet>/manager/leader. The key is created only if absent (a transaction comparing its
create revision with 0) and attached to a lease of LEASE_TTL_S seconds that the leader renews
every RENEW_INTERVAL_S. In the same transaction /pgcarve/<fleet>/manager/epoch goes up by one
(compared on its mod revision, so two campaigns cannot both write epoch N): the fencing epoch,
which grows on every takeover. The key holds who leads (pid, host, URL, epoch).

The others (standbys) read the key every POLL_INTERVAL_S and campaign as soon as it is gone: etcd
deletes it when the leader's lease lapses (its process or its machine lost) or when a leader that
stops cleanly deletes it. Worst case from the leader's last renewal to a new leader:
LEASE_TTL_S + etcd's expiry sweep (0.5 s) + POLL_INTERVAL_S + one request (2 s) = 13.5 s
(TAKEOVER_BOUND_S). On the leader's own machine a key naming a process that no longer runs
(killed, crashed; checked by its process record) is deleted at once, so a restarted manager does
not wait for the lease. etcd gives every lease a full TTL again when its own leader changes, so an
etcd election does not depose the manager, and the TTL is longer than one.

A new leader first takes over (control/terms.py: what the previous one left half-way, the journal)
and only then `leads()`: until then mutations are refused and no operation runs.

Fencing: `check()` is called before every step that changes something (each libvirt define,
start, stop, undefine and volume change, each admin session on a guest, each journal write, each
API mutation). It passes only while this process holds the lease at the epoch the current work
began with, judged on this machine's monotonic clock: the lease is trusted until the time the
renewal was *sent* plus its TTL, less MARGIN_S. A leader paused (SIGSTOP) past its lease finds,
when it resumes, that the clock went on without it, whichever of its threads runs first: the
step is refused, and the campaign loop steps down. etcd cannot expire the key before that
deadline, since it counts the TTL from when it received the renewal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import Compare, EtcdClient, EtcdKv, KeyValue
from pgcarve.errors import DcsUnavailable, NotLeader
from pgcarve.processes import ProcessRecord, ProcessStatus, boot_id, check, record_self

log = logging.getLogger("pgcarve.control.leadership")

LEASE_TTL_S = 10  # longer than an etcd leader election (the sandbox's: 5 s), so one does not depose us
RENEW_INTERVAL_S = 2.0
RETRY_INTERVAL_S = 0.5  # after a failed renewal: the next etcd leader is found quickly
POLL_INTERVAL_S = 1.0
MARGIN_S = 1.0  # the lease is trusted for TTL - MARGIN_S after a renewal was sent
ETCD_EXPIRY_SWEEP_S = 0.5  # etcd's leader looks for lapsed leases twice a second
REQUEST_TIMEOUT_S = 2.0  # each request of the campaign loop: a slow etcd must not eat the lease
TAKEOVER_BOUND_S = LEASE_TTL_S + ETCD_EXPIRY_SWEEP_S + POLL_INTERVAL_S + REQUEST_TIMEOUT_S  # 13.5 s

RoleName = Literal["leader", "standby"]


def leader_key(fleet: str) -> str:
    return f"/pgcarve/{fleet}/manager/leader"


def epoch_key(fleet: str) -> str:
    return f"/pgcarve/{fleet}/manager/epoch"


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads, as the leader key says."""

    id: str  # one per manager process's campaign (pid and host alone may repeat in containers)
    pid: int
    host: str
    start_time: int  # with boot_id: the process record (pgcarve.processes), so a dead leader is known
    boot_id: str
    url: str | None
    epoch: int
    since: float  # Unix time it took over

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str) -> LeaderInfo | None:
        try:
            doc = json.loads(text)
            return cls(id=str(doc["id"]), pid=int(doc["pid"]), host=str(doc["host"]),
                       start_time=int(doc.get("start_time", 0)), boot_id=str(doc.get("boot_id", "")),
                       url=doc.get("url"), epoch=int(doc["epoch"]), since=float(doc["since"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        where = self.url or "no URL given"
        return f"the manager at {where} (pid {self.pid} on {self.host}, epoch {self.epoch})"


@dataclass(frozen=True)
class Role:
    """This manager's role now, for /healthz and the 503 of a refused mutation."""

    role: RoleName
    epoch: int | None  # this manager's epoch while it leads
    leader: LeaderInfo | None  # whoever leads, as last read (this manager itself when leading)
    error: str | None  # the last etcd error, if the last attempt failed


class Leadership:
    """The campaign loop and the fence. `on_elected(epoch)` and `on_lost(epoch, reason)` are called
    from the loop's thread and must return quickly (start the work on a thread of their own)."""

    def __init__(self, config: EtcdConfig, fleet: str, url: str | None = None,
                 on_elected: Callable[[int], None] | None = None,
                 on_lost: Callable[[int, str], None] | None = None,
                 ttl_s: int = LEASE_TTL_S, renew_s: float = RENEW_INTERVAL_S, poll_s: float = POLL_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s - MARGIN_S <= renew_s:
            raise ValueError(f"a lease of {ttl_s} s cannot be renewed every {renew_s} s with a {MARGIN_S} s margin")
        self.config = config
        self.fleet = fleet
        self.url = url
        self.on_elected = on_elected or (lambda _epoch: None)
        self.on_lost = on_lost or (lambda _epoch, _reason: None)
        self.ttl_s, self.renew_s, self.poll_s, self.clock = ttl_s, renew_s, poll_s, clock
        self.key, self.epoch_key = leader_key(fleet), epoch_key(fleet)
        self.pid, self.host, self.id = os.getpid(), socket.gethostname(), uuid.uuid4().hex[:12]
        self.refused = 0  # steps the fence refused, for /healthz
        self._client = EtcdClient(config, timeout_s=min(config.timeout_s, REQUEST_TIMEOUT_S))
        self._kv = EtcdKv(self._client)
        self._guard = threading.Lock()
        self._epoch: int | None = None
        self._ready_epoch: int | None = None  # the epoch whose takeover is done (control/terms.py)
        self._lease: str | None = None
        self._create_revision = 0
        self._valid_until = float("-inf")
        self._leader: LeaderInfo | None = None
        self._error: str | None = None
        self._bound = threading.local()  # the epoch the work on this thread began with
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pgcarve-leadership", daemon=True)

    # -- lifecycle -----------------------------------------------------------------------------

    def campaign_once(self) -> int | None:
        """One attempt, on the caller's thread (a server's start: a fleet's only manager leads
        before it serves); the epoch won, or None."""
        try:
            self._campaign()
        except DcsUnavailable as exc:
            self._error = str(exc)
            log.warning("etcd: %s", exc)
        with self._guard:
            return self._epoch

    def start(self) -> None:
        log.info("campaigning for %s in etcd (lease %d s, renewed every %g s; a standby takes over within "
                 "%.1f s of the leader's last renewal)", self.key, self.ttl_s, self.renew_s, TAKEOVER_BOUND_S)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning; a leader hands over at once by deleting its key and lease."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._guard:
            lease, revision, epoch = self._lease, self._create_revision, self._epoch
            self._epoch, self._lease, self._valid_until = None, None, float("-inf")
        if lease is not None:
            with contextlib.suppress(DcsUnavailable):
                # Only the key of this term: a successor's key has another create revision.
                self._kv.txn([Compare(self.key, "CREATE", revision)], {}, deletes=[self.key])
                self._kv.revoke(lease)
            log.info("handed over: leader key of epoch %s deleted", epoch)
        self._client.close()

    # -- the fence -----------------------------------------------------------------------------

    def holds(self) -> bool:
        """Whether this manager may run operations and write the journal now: it leads (the lease
        held, within its deadline, the takeover done) at the epoch the work on this thread began with."""
        bound = getattr(self._bound, "epoch", None)
        with self._guard:
            epoch = self._epoch
        return self.leads() and (bound is None or bound == epoch)

    def leads(self) -> bool:
        """The lease held and the takeover done: what the API's mutation gate and /healthz ask."""
        with self._guard:
            epoch, ready, valid_until = self._epoch, self._ready_epoch, self._valid_until
        return epoch is not None and ready == epoch and self.clock() < valid_until

    def mark_ready(self, epoch: int) -> None:
        """The takeover at `epoch` is done (the journal resumed): mutations are accepted now."""
        with self._guard:
            self._ready_epoch = epoch

    def check(self, what: str) -> int:
        """Raise NotLeader (naming the leader) unless this manager may act; returns the epoch."""
        with self._guard:
            epoch, valid_until, leader = self._epoch, self._valid_until, self._leader
        bound = getattr(self._bound, "epoch", None)
        if epoch is not None and self.clock() < valid_until and (bound is None or bound == epoch):
            return epoch
        self.refused += 1
        if bound is not None and epoch is not None and bound != epoch:
            why = f"it began this work at epoch {bound} and leads at epoch {epoch} now"
        elif bound is not None:
            why = f"it began this work as leader at epoch {bound} and no longer holds the lease"
        else:
            why = "it does not hold the fleet's leadership lease"
        other = leader if leader is not None and not self.is_me(leader) else None
        raise NotLeader(f"{what}: refused, {why}; "
                        + (f"the leader is {other.describe()}" if other else "no leader is known yet") + ". "
                        "Send changes to the leader.")

    @contextlib.contextmanager
    def acting(self) -> Iterator[int]:
        """Run a piece of work bound to the current epoch: every check() on this thread inside it
        refuses once the epoch changed, even if this manager leads again meanwhile."""
        epoch = self.check("starting work")
        previous = getattr(self._bound, "epoch", None)
        self._bound.epoch = epoch
        try:
            yield epoch
        finally:
            self._bound.epoch = previous

    def is_me(self, info: LeaderInfo) -> bool:
        return info.id == self.id

    def read_leader(self) -> LeaderInfo | None:
        """Who leads, asked of etcd now (for a refusal that names the leader); the last known
        leader if etcd does not answer."""
        with contextlib.suppress(DcsUnavailable):
            current = self._kv.get(self.key)
            if current is None:
                with self._guard:
                    self._leader = None
            else:
                self._seen(current)
        with self._guard:
            return self._leader

    def role(self) -> Role:
        leading = self.leads()
        with self._guard:
            return Role(role="leader" if leading else "standby", epoch=self._epoch if leading else None,
                        leader=self._leader, error=self._error)

    def holds_lease(self) -> bool:
        with self._guard:
            return self._epoch is not None and self.clock() < self._valid_until

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        interval = 0.0
        while not self._stop.wait(interval):
            leading = self._epoch is not None
            try:
                if leading:
                    self._renew()
                else:
                    self._campaign()
                self._error = None
            except DcsUnavailable as exc:
                self._error = str(exc)
                log.warning("etcd: %s", exc)
                if leading and self.clock() >= self._valid_until:
                    self._lose("the lease could not be renewed before it lapsed")
            if self._epoch is None:
                interval = self.poll_s
            else:
                interval = RETRY_INTERVAL_S if self._error else self.renew_s

    def _campaign(self) -> None:
        current = self._kv.get(self.key)
        if current is not None and self._dead_here(current):
            # Its lease would keep the key for up to a TTL; a restarted manager need not wait.
            self._kv.txn([Compare(self.key, "CREATE", current.create_revision)], {}, deletes=[self.key])
            current = self._kv.get(self.key)
        if current is not None:
            self._seen(current)
            return
        epoch_kv = self._kv.get(self.epoch_key)
        epoch = _as_epoch(epoch_kv) + 1
        sent = self.clock()
        lease = self._kv.grant(self.ttl_s)
        me = record_self()
        mine = LeaderInfo(id=self.id, pid=self.pid, host=self.host, start_time=me.start_time, boot_id=me.boot_id,
                          url=self.url, epoch=epoch, since=time.time())
        won = self._kv.txn([Compare(self.key, "CREATE", 0),
                            Compare(self.epoch_key, "MOD", epoch_kv.mod_revision if epoch_kv else 0)],
                           {self.key: mine.to_json(), self.epoch_key: str(epoch)}, lease=lease, lease_keys=[self.key])
        if not won:
            with contextlib.suppress(DcsUnavailable):
                self._kv.revoke(lease)
            return
        created = self._kv.get(self.key)
        with self._guard:
            self._epoch, self._lease, self._leader = epoch, lease, mine
            self._create_revision = created.create_revision if created is not None else 0
            self._valid_until = sent + self.ttl_s - MARGIN_S
        log.warning("this manager leads the fleet now (epoch %d, %s)", epoch, self.url or "no URL")
        self.on_elected(epoch)

    def _renew(self) -> None:
        if self.clock() >= self._valid_until:  # paused, or etcd slow, past the lease: do not renew
            self._lose("the lease lapsed before it was renewed (was this process paused?)")
            return
        sent = self.clock()
        ttl = self._kv.keepalive(str(self._lease))
        if ttl <= 0:
            self._lose("etcd says the lease lapsed")
            return
        current = self._kv.get(self.key)
        if current is None or current.create_revision != self._create_revision:
            self._lose("the leader key is gone or another manager's")
            if current is not None:
                self._seen(current)
            return
        with self._guard:
            if self._epoch is not None:
                self._valid_until = sent + ttl - MARGIN_S

    def _dead_here(self, current: KeyValue) -> bool:
        """The key names a manager process of this machine (same host name, same boot) that no
        longer runs: killed, crashed. (A paused one still runs: its lease decides.)"""
        info = LeaderInfo.parse(current.value)
        if info is None or info.host != self.host or info.boot_id != boot_id() or info.pid == self.pid:
            return False
        if check(ProcessRecord(info.pid, info.start_time, info.boot_id)) is ProcessStatus.RUNNING:
            return False
        log.warning("the leader key names %s, which no longer runs on this machine: taking its place", info.describe())
        return True

    def _seen(self, current: KeyValue) -> None:
        info = LeaderInfo.parse(current.value)
        with self._guard:
            changed = info != self._leader
            self._leader = info
        if changed and info is not None:
            log.info("standby: the fleet's leader is %s", info.describe())

    def _lose(self, reason: str) -> None:
        with self._guard:
            epoch, lease = self._epoch, self._lease
            self._epoch, self._lease, self._valid_until, self._ready_epoch = None, None, float("-inf"), None
        if epoch is None:
            return
        log.warning("this manager no longer leads (epoch %d): %s; standing by", epoch, reason)
        if lease is not None:
            with contextlib.suppress(DcsUnavailable):
                self._kv.revoke(lease)  # a lease still alive in etcd would delay whoever comes next
        self.on_lost(epoch, reason)


def _as_epoch(found: KeyValue | None) -> int:
    try:
        return int(found.value) if found is not None else 0
    except ValueError:
        return 0


def describe_role(leadership: Leadership | None) -> dict[str, Any]:
    """What /healthz says about leadership."""
    if leadership is None:
        return {"role": "leader", "lease": "none: the hosts file has no etcd section, so one manager per state "
                                           "directory (an flock on manager.lock) and no standby"}
    role = leadership.role()
    doc: dict[str, Any] = {"role": role.role, "epoch": role.epoch, "lease": f"etcd {leadership.key}, "
                           f"{leadership.ttl_s} s", "refused_steps": leadership.refused}
    if role.leader is not None:
        doc["leader"] = {"url": role.leader.url, "pid": role.leader.pid, "host": role.leader.host,
                         "epoch": role.leader.epoch}
    if role.error:
        doc["etcd_error"] = role.error
    return doc
