"""Who leads each instance, as Patroni's keys in etcd say (replication.roles: patroni).

Patroni in each guest holds its instance's leader key (`/service/<instance>/leader`, its value the
member name, which is the guest's application_name); the manager only reads it. All of the
fleet's keys come in one etcd request (patroni/store.py), kept for a second so that one listing
of the fleet asks once. When etcd does not answer, no instance has a known leader: the manager
then shows none rather than guess from its own records.
"""

from __future__ import annotations

import logging
import threading
import time

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.errors import DcsUnavailable
from pgcarve.patroni.store import purge_cluster, read_all
from pgcarve.patroni.view import ClusterView

FRESH_S = 1.0
log = logging.getLogger("pgcarve.patroni")


def guest_of_member(member: str) -> str:
    """The guest a Patroni member name stands for (members are named by application_name)."""
    return member.replace("_", "-")


class PatroniClusters:
    def __init__(self, config: EtcdConfig):
        self.config = config
        self._guard = threading.Lock()
        self._views: dict[str, ClusterView] = {}
        self._read_at = -1e9
        self.error: str | None = None

    def _refresh(self) -> None:
        try:
            with EtcdClient(self.config) as etcd:
                self._views = read_all(etcd)
        except DcsUnavailable as exc:
            if self.error is None:
                log.warning("Patroni's keys cannot be read (%s): no instance shows a primary until they can", exc)
            self.error = str(exc)
            self._views = {}
            return
        self.error = None

    def view(self, instance: str, fresh: bool = False) -> ClusterView | None:
        """`instance`'s Patroni cluster as etcd holds it; None when it has no keys or etcd does not
        answer (then `error` says why)."""
        with self._guard:
            if fresh or time.monotonic() - self._read_at > FRESH_S:
                self._refresh()
                self._read_at = time.monotonic()
            return self._views.get(instance)

    def last_read(self) -> tuple[dict[str, ClusterView], float | None]:
        """Every instance's view as last read (the listing refreshes it every couple of seconds),
        and when (monotonic; None before the first read): for /metrics, which never asks etcd."""
        with self._guard:
            return dict(self._views), (self._read_at if self._read_at > 0 else None)

    def leader(self, instance: str, fresh: bool = False) -> str | None:
        """The guest holding `instance`'s leader key; None when none does or etcd does not answer."""
        view = self.view(instance, fresh)
        return guest_of_member(view.leader) if view is not None and view.leader else None

    def forget(self, instance: str) -> None:
        """Remove every Patroni key of `instance` (its guests are gone for good)."""
        with EtcdClient(self.config) as etcd:
            deleted = purge_cluster(etcd, instance)
        if deleted:
            log.info("%s: removed its %d Patroni key(s) from etcd", instance, deleted)
        with self._guard:
            self._views.pop(instance, None)


def patroni_doc(view: ClusterView | None, error: str | None) -> dict[str, object]:
    """What an operator reads first about one instance under Patroni (the API's `patroni` field and
    the dashboard): who leads, which standbys are synchronous, the timeline, each member's state;
    with `problem` saying in words what is wrong, or None."""
    if view is None:
        missing = f"etcd cannot be read: {error}" if error else "no Patroni keys in etcd for this instance yet"
        return {"leader": None, "synchronous": [], "synchronous_mode": None, "timeline": None, "paused": False,
                "members": [], "problem": missing}
    members = [{"name": guest_of_member(m.name), "role": m.role, "state": m.state, "timeline": m.timeline,
                "lag_bytes": m.lag_bytes} for m in view.members]
    synchronous = [guest_of_member(s) for s in view.synchronous_standbys]
    mode = view.settings.synchronous_mode if view.settings is not None else None
    problem: str | None = None
    if view.leader is None:
        problem = "no leader: nobody holds the leader key, commits are not accepted"
    elif not synchronous and mode not in (None, "off"):
        problem = "no synchronous standby: commits wait until one is chosen (strict mode)"
    elif view.paused:
        problem = "paused: Patroni does not fail over (patronictl resume)"
    return {"leader": guest_of_member(view.leader) if view.leader else None, "synchronous": synchronous,
            "synchronous_mode": mode, "timeline": view.timeline, "paused": view.paused, "members": members,
            "problem": problem}
