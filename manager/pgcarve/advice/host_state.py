"""Is the host left as it was? The guests (of any fleet) and storage volumes on each host, before
and after an advice run, and what differs."""

from __future__ import annotations

import contextlib

from pgcarve.control.fleet import Fleet
from pgcarve.errors import PgcarveError

HostState = dict[str, dict[str, list[str]]]


def host_state(fleet: Fleet) -> HostState:
    """Per host of the fleet: the names of its pgcarve guests and of its pool's volumes."""
    state: HostState = {}
    for name, host in fleet.hosts.items():
        volumes: list[str] = []
        with contextlib.suppress(PgcarveError):  # no pool yet: nothing in it
            volumes = sorted(host.storage.volume_names())
        state[name] = {"guests": sorted(g.name for g in host.guests()), "volumes": volumes}
    return state


def differences(before: HostState, after: HostState) -> list[str]:
    """What `after` has that `before` had not, and the other way round, host by host."""
    found = []
    for host in sorted(set(before) | set(after)):
        for kind in ("guests", "volumes"):
            was = set(before.get(host, {}).get(kind, []))
            now = set(after.get(host, {}).get(kind, []))
            found += [f"{host}: {kind[:-1]} {name} added" for name in sorted(now - was)]
            found += [f"{host}: {kind[:-1]} {name} removed" for name in sorted(was - now)]
    return found
