"""Who decides an instance's roles, as its guests recorded it when they were made, against the
hosts file's replication.roles.

An instance made under one decider is never driven by the other. Under Patroni the manager would
look for the leader key of an instance whose guests run no Patroni, find none and see no primary;
under the manager's HA loop, a Patroni instance's primary would be fenced, and its standbys
promoted, behind Patroni's back. So such an instance is observed (control/fleet.py marks it:
Instance.roles_mismatch) and left alone: the HA loop says so once and repairs nothing, and
retiring, bringing back, a switchover or failover by hand and a backup refuse with the same
words (RolesMismatch) before they change anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from pgcarve.config import FleetConfig
from pgcarve.errors import RolesMismatch
from pgcarve.virt.domain_xml import Roles
from pgcarve.virt.host import GuestInfo

log = logging.getLogger(__name__)

_MADE_UNDER = {"manager": "the manager's roles (no Patroni in its guests)",
               "patroni": "Patroni's roles (Patroni in its guests, its leader key in etcd)"}
_FILE_SAYS = {"manager": "the manager decides roles (replication.roles: manager)",
              "patroni": "Patroni decides roles (replication.roles: patroni)"}
_KEEP = {"manager": "Set replication.roles: manager in the hosts file to keep running it as it is",
         "patroni": "Set replication.roles: patroni in the hosts file (with its etcd section) to keep running it "
                    "as it is"}
_MOVE = {"manager": "moving an instance to the manager's roles is not built yet",
         "patroni": "moving an instance to Patroni is not built yet"}

_said: set[str] = set()
_said_guard = threading.Lock()


def configured_roles(config: FleetConfig) -> Roles:
    """Who decides roles in this fleet: the hosts file's replication.roles (resolved when the file
    is read; a config built without it is the manager's)."""
    return config.replication.roles or "manager"


def mismatch(instance: str, guests: Iterable[tuple[str, Roles]], configured: Roles) -> str | None:
    """Why pgcarve leaves `instance` alone, in words, when any of its guests ((name, roles recorded)
    pairs) was made under another decider of roles than `configured`; None when none was."""
    guests = list(guests)
    other = sorted(name for name, roles in guests if roles != configured)
    if not other:
        return None
    made = "patroni" if configured == "manager" else "manager"
    subject = instance if len(other) == len(guests) else f"{instance} (its guests {', '.join(other)})"
    return (f"{subject} was made under {_MADE_UNDER[made]} but this fleet's hosts file says {_FILE_SAYS[configured]}: "
            "pgcarve does not act on it (no repair, retirement, bring-back, switchover, failover or backup). "
            f"{_KEEP[made]}; {_MOVE[configured]}")


def refuse(message: str | None) -> None:
    """Raise RolesMismatch with `message` (an instance's roles_mismatch), if there is one."""
    if message:
        raise RolesMismatch(message)


def guest_left_alone(info: GuestInfo, config: FleetConfig) -> bool:
    """left_alone for the instance of one guest (a lifecycle event's), from its own metadata."""
    meta = info.metadata
    return left_alone(mismatch(meta.cluster, [(info.name, meta.roles)], configured_roles(config)))


def left_alone(message: str | None) -> bool:
    """Whether the HA loop leaves an instance alone (it has a roles mismatch); says why in the log,
    once per message rather than on every sweep."""
    if not message:
        return False
    with _said_guard:
        first = message not in _said
        _said.add(message)
    if first:
        log.warning("%s", message)
    return True
