"""Who leads each instance, as Patroni's leader keys in etcd say (replication.roles: patroni).

Patroni in each guest holds its instance's leader key (`/service/<instance>/leader`, its value
the member name, which is the guest's application_name); the manager only reads it. All of the
fleet's keys come in one etcd request, kept for a second so that one listing of the fleet asks
once. When etcd does not answer, no instance has a known leader: the manager then shows none
rather than guess from its own records.
"""

from __future__ import annotations

import logging
import threading
import time

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.errors import DcsUnavailable

NAMESPACE = "/service/"
FRESH_S = 1.0
log = logging.getLogger("pgcarve.patroni")


def guest_of_member(member: str) -> str:
    """The guest a Patroni member name stands for (members are named by application_name)."""
    return member.replace("_", "-")


class PatroniLeaders:
    def __init__(self, config: EtcdConfig):
        self.config = config
        self._guard = threading.Lock()
        self._leaders: dict[str, str] = {}
        self._read_at = -1e9
        self.error: str | None = None

    def _refresh(self) -> None:
        try:
            with EtcdClient(self.config) as etcd:
                keys = etcd.get_prefix(NAMESPACE)
        except DcsUnavailable as exc:
            if self.error is None:
                log.warning("Patroni's leader keys cannot be read (%s): no instance shows a primary until they can",
                            exc)
            self.error = str(exc)
            self._leaders = {}
            return
        self.error = None
        self._leaders = {key[len(NAMESPACE):-len("/leader")]: guest_of_member(value.decode())
                         for key, value in keys.items() if key.endswith("/leader") and key.count("/") == 3}

    def leader(self, instance: str, fresh: bool = False) -> str | None:
        """The guest holding `instance`'s leader key; None when none does or etcd does not answer."""
        with self._guard:
            if fresh or time.monotonic() - self._read_at > FRESH_S:
                self._refresh()
                self._read_at = time.monotonic()
            return self._leaders.get(instance)

    def forget(self, instance: str) -> None:
        """Remove every Patroni key of `instance` (its guests are gone for good)."""
        with EtcdClient(self.config) as etcd:
            deleted = etcd.delete_prefix(f"{NAMESPACE}{instance}/")
        log.info("%s: removed its %d Patroni key(s) from etcd", instance, deleted)
        with self._guard:
            self._leaders.pop(instance, None)
