"""What Patroni's keys in etcd say about one cluster (one pgcarve instance), as immutable snapshots.

Pure: it reads `KeyValue`s that dcs/etcd.py fetched and never asks anything itself. The layout is
Patroni's (patroni/dcs/__init__.py and dcs/etcd3.py; the same in 3.0, Debian 12, and 4.0, Debian
13; verified on real clusters, tests/data/patroni/): under `<namespace><scope>/`

- `leader`: the leader's member name, under the leader's lease (gone when it stops renewing it);
- `members/<name>`: JSON under that member's lease: conn_url, api_url, state, role ("master" in
  3.0, "primary" in 4.0, "replica", "standby_leader"), version, xlog_location (an LSN as an
  integer), timeline, replication_state (4.0, standbys: "streaming", "in archive recovery"), tags,
  pause, pending_restart;
- `sync`: {"leader", "sync_standby": "a,b", "quorum" (4.0; > 0 in quorum mode)};
- `status`: {"optime": the leader's last LSN, "slots", "retain_slots" (4.0)};
- `config`: the dynamic settings (ttl, loop_wait, synchronous_mode (true, or "quorum" in 4.0),
  synchronous_mode_strict, failsafe_mode, "pause": true while paused, postgresql: {...});
- `failsafe`: {member name: api_url}, the members the leader must reach to keep its role while etcd
  is lost (written when failsafe_mode is on);
- `history`: [[timeline, LSN, reason, timestamp, new leader], ...], one line per ended timeline;
- `initialize`: the database system identifier; `failover`: a requested switchover ("{}" after
  one is done); an old `optime/leader`: the leader's LSN before `status` existed.

A value Patroni itself would not parse is read as absent, as Patroni does, rather than failing the
whole view: one cluster's bad key must not hide the fleet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pgcarve.dcs.etcd import KeyValue

NAMESPACE = "/service/"
# Patroni's own roles for a leader: 3.0 writes "master", 4.0 "primary".
PRIMARY_ROLES = frozenset({"master", "primary"})
_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def check_namespace(namespace: str) -> str:
    """Patroni's namespace as a key prefix (`/service/`); ValueError if it is not one."""
    if len(namespace) < 3 or not namespace.startswith("/") or not namespace.endswith("/"):
        raise ValueError(f"Patroni's namespace {namespace!r} must be a directory, starting and ending with '/' "
                         "(default /service/)")
    return namespace


def scope_prefix(scope: str, namespace: str = NAMESPACE) -> str:
    """`/service/<scope>/`; ValueError for a scope that is not one name (it must not reach into,
    or cover, another scope's keys)."""
    if not _SCOPE.fullmatch(scope):
        raise ValueError(f"{scope!r} is not a Patroni scope: 1 to 63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return f"{check_namespace(namespace)}{scope}/"


@dataclass(frozen=True)
class MemberView:
    """One member as its own key describes it (written by its Patroni every loop_wait)."""

    name: str
    role: str  # "primary" (3.0's "master" is read as it), "replica", "standby_leader", ...
    state: str  # "running", "starting", "stopped", "crashed", "creating replica", ...
    replication_state: str | None  # a standby's, in 4.0: "streaming", "in archive recovery"
    timeline: int | None
    wal_position: int | None  # xlog_location: written on a primary, received/replayed on a standby
    lag_bytes: int | None  # the leader's last LSN (status.optime) minus wal_position; None: unknown or leader
    conn_url: str | None
    api_url: str | None
    patroni_version: str | None
    tags: Mapping[str, Any]
    paused: bool
    pending_restart: bool
    lease: str  # the member's etcd lease ("0": none)

    @property
    def nofailover(self) -> bool:
        return bool(self.tags.get("nofailover"))

    @property
    def nosync(self) -> bool:
        return bool(self.tags.get("nosync"))

    @property
    def running(self) -> bool:
        return self.state == "running"


@dataclass(frozen=True)
class SyncView:
    """The `sync` key: who the leader last made synchronous. `quorum` > 0 only in Patroni 4's
    quorum mode, where a standby needs `quorum` others of leader + standbys to agree to promote."""

    leader: str | None
    standbys: tuple[str, ...]
    quorum: int


@dataclass(frozen=True)
class SettingsView:
    """The dynamic settings (`config` key) that pgcarve shows and decides on."""

    synchronous_mode: str  # "off", "on", or "quorum" (Patroni 4)
    synchronous_mode_strict: bool
    failsafe_mode: bool
    paused: bool
    ttl: int | None
    loop_wait: int | None
    retry_timeout: int | None
    maximum_lag_on_failover: int | None
    raw: Mapping[str, Any]


@dataclass(frozen=True)
class TimelineSwitch:
    """One line of `history`: `timeline` ended at `lsn`, and `new_leader` (when Patroni knew it) took over."""

    timeline: int
    lsn: int
    reason: str
    at: str | None
    new_leader: str | None


@dataclass(frozen=True)
class PendingSwitchover:
    """A `failover` key with content: a switchover or failover asked for and not done yet."""

    leader: str | None
    candidate: str | None
    scheduled_at: str | None


@dataclass(frozen=True)
class ClusterView:
    """One Patroni cluster (scope), as its keys stood at one etcd revision."""

    scope: str
    revision: int
    leader: str | None  # the leader key's value: the member that holds the lock, or None
    members: tuple[MemberView, ...]  # sorted by name
    sync: SyncView | None
    settings: SettingsView | None  # None before the first member bootstrapped the cluster
    failsafe_members: Mapping[str, str] | None  # failsafe topology: name -> api_url
    leader_lsn: int | None  # status.optime
    slots: Mapping[str, int]
    history: tuple[TimelineSwitch, ...]
    system_identifier: str | None  # `initialize`: the cluster was bootstrapped
    pending: PendingSwitchover | None

    def member(self, name: str) -> MemberView | None:
        return next((m for m in self.members if m.name == name), None)

    @property
    def leader_member(self) -> MemberView | None:
        return self.member(self.leader) if self.leader else None

    @property
    def synchronous_standbys(self) -> tuple[str, ...]:
        """The standbys the current leader made synchronous (none when synchronous mode is off, or the
        `sync` key names another leader: a stale one, from before a failover Patroni has not yet redone)."""
        if self.settings is None or self.settings.synchronous_mode == "off" or self.sync is None:
            return ()
        if self.leader is None or (self.sync.leader or "").lower() != self.leader.lower():
            return ()
        return self.sync.standbys

    @property
    def timeline(self) -> int | None:
        """The leader's timeline, else the one after the last ended one in `history`."""
        leader = self.leader_member
        if leader is not None and leader.timeline is not None:
            return leader.timeline
        return self.history[-1].timeline + 1 if self.history else None

    @property
    def paused(self) -> bool:
        return self.settings is not None and self.settings.paused

    @property
    def failsafe_mode(self) -> bool:
        """failsafe_mode is on: a leader that loses etcd keeps its role while it reaches every
        member of `failsafe_members` (whether that is happening now only its REST API says)."""
        return self.settings is not None and self.settings.failsafe_mode


# -- parsing, one key at a time --------------------------------------------------------------------

def _json(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None


def int_or_none(value: Any) -> int | None:
    """An integer as Patroni wrote it (a number or its text); None for anything else, booleans included."""
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _str(value: Any) -> str | None:
    return str(value) if value is not None and value != "" else None


def _frozen(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


def _member(name: str, kv: KeyValue, leader_lsn: int | None, leader: str | None) -> MemberView:
    data = _json(kv.value)
    if isinstance(data, str) or not isinstance(data, dict):
        data = {}  # Patroni reads an unparsable member as one with no data (and very old "postgres://" values)
    role = str(data.get("role", "unknown"))
    wal = int_or_none(data.get("xlog_location"))
    lag = None
    if name != leader and wal is not None and leader_lsn is not None:
        lag = max(0, leader_lsn - wal)  # as Patroni's /cluster computes it
    tags = data.get("tags")
    return MemberView(
        name=name, role="primary" if role in PRIMARY_ROLES else role, state=str(data.get("state", "unknown")),
        replication_state=_str(data.get("replication_state")), timeline=int_or_none(data.get("timeline")),
        wal_position=wal, lag_bytes=lag, conn_url=_str(data.get("conn_url")), api_url=_str(data.get("api_url")),
        patroni_version=_str(data.get("version")), tags=_frozen(tags if isinstance(tags, dict) else {}),
        paused=bool(data.get("pause")), pending_restart=bool(data.get("pending_restart")), lease=kv.lease)


def _sync(value: str) -> SyncView | None:
    data = _json(value)
    if not isinstance(data, dict) or not data.get("leader"):
        return None  # Patroni: an empty SyncState
    standbys = tuple(s.strip() for s in str(data.get("sync_standby") or "").split(",") if s.strip())
    return SyncView(str(data["leader"]), standbys, int_or_none(data.get("quorum")) or 0)


def _synchronous_mode(value: Any) -> str:
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered == "quorum":
            return "quorum"
        return "on" if lowered in ("on", "true", "yes", "1") else "off"
    return "on" if value is True else "off"


def _settings(value: str) -> SettingsView | None:
    data = _json(value)
    if not isinstance(data, dict):
        return None
    return SettingsView(
        synchronous_mode=_synchronous_mode(data.get("synchronous_mode")),
        synchronous_mode_strict=bool(data.get("synchronous_mode_strict")),
        failsafe_mode=bool(data.get("failsafe_mode")), paused=bool(data.get("pause")),
        ttl=int_or_none(data.get("ttl")), loop_wait=int_or_none(data.get("loop_wait")),
        retry_timeout=int_or_none(data.get("retry_timeout")),
        maximum_lag_on_failover=int_or_none(data.get("maximum_lag_on_failover")), raw=_frozen(data))


def _history(value: str) -> tuple[TimelineSwitch, ...]:
    data = _json(value)
    lines = []
    for line in data if isinstance(data, list) else []:
        if not isinstance(line, list) or len(line) < 3 or int_or_none(line[0]) is None or int_or_none(line[1]) is None:
            continue
        lines.append(TimelineSwitch(int(line[0]), int(line[1]), str(line[2]),
                                    _str(line[3]) if len(line) > 3 else None,
                                    _str(line[4]) if len(line) > 4 else None))
    return tuple(lines)


def _status(status: str | None, legacy_optime: str | None) -> tuple[int | None, Mapping[str, int]]:
    data = _json(status) if status is not None else None
    if isinstance(data, dict):
        slots = data.get("slots")
        clean = {str(k): v for k, v in slots.items() if int_or_none(v) is not None} if isinstance(slots, dict) else {}
        return int_or_none(data.get("optime")), _frozen({k: int(v) for k, v in clean.items()})
    if isinstance(data, int):  # a bare LSN: the legacy form Patroni still reads
        return data, _frozen({})
    return (int_or_none(legacy_optime) if legacy_optime is not None else None), _frozen({})


def _pending(value: str) -> PendingSwitchover | None:
    data = _json(value)
    if not isinstance(data, dict) or not (data.get("leader") or data.get("member") or data.get("candidate")):
        return None  # "{}": the last one was carried out
    return PendingSwitchover(_str(data.get("leader")), _str(data.get("member") or data.get("candidate")),
                             _str(data.get("scheduled_at")))


def cluster_view(scope: str, revision: int, keys: Mapping[str, KeyValue]) -> ClusterView:
    """The view of one scope from its keys, named relative to the scope (`leader`, `members/a`, ...)."""
    leader_kv = keys.get("leader")
    leader = leader_kv.value.strip() or None if leader_kv is not None else None
    status, legacy = keys.get("status"), keys.get("optime/leader")
    leader_lsn, slots = _status(status.value if status else None, legacy.value if legacy else None)
    members = tuple(sorted((_member(rel.removeprefix("members/"), kv, leader_lsn, leader)
                            for rel, kv in keys.items() if rel.startswith("members/") and rel.count("/") == 1
                            and rel != "members/"), key=lambda m: m.name))
    failsafe = _json(keys["failsafe"].value) if "failsafe" in keys else None
    config, sync, history, pending, initialize = (keys.get(k) for k in ("config", "sync", "history", "failover",
                                                                        "initialize"))
    return ClusterView(
        scope=scope, revision=revision, leader=leader, members=members,
        sync=_sync(sync.value) if sync else None, settings=_settings(config.value) if config else None,
        failsafe_members=_frozen({str(k): str(v) for k, v in failsafe.items()}) if isinstance(failsafe, dict) else None,
        leader_lsn=leader_lsn, slots=slots, history=_history(history.value) if history else (),
        system_identifier=_str(initialize.value.strip()) if initialize else None,
        pending=_pending(pending.value) if pending else None)


def cluster_views(kvs: Iterable[KeyValue], revision: int, namespace: str = NAMESPACE) -> dict[str, ClusterView]:
    """Every scope with keys under `namespace`, each as a view: scope -> ClusterView. Keys of
    other layouts (Citus groups, `<scope>/<group>/...`) are left out."""
    grouped: dict[str, dict[str, KeyValue]] = {}
    for kv in kvs:
        if not kv.key.startswith(namespace):
            continue
        scope, _, rest = kv.key[len(namespace):].partition("/")
        if scope and rest:
            grouped.setdefault(scope, {})[rest] = kv
    return {scope: cluster_view(scope, revision, keys) for scope, keys in sorted(grouped.items())}
