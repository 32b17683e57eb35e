"""Where applications connect: an instance's libpq URIs over all of its guests.

An instance's guests keep their names for its whole life (a promoted standby keeps its name, a
rebuilt guest takes the name of the one it replaces, a member built again on another standby host
takes that host's name, which is listed already), so its URIs list the same hosts in the same
order whatever happened, and libpq finds the primary (`target_session_attrs=read-write`) or a
standby (`prefer-standby`) by asking each host: the same string reaches the new primary after a
failover, with no new question to the API. In the sandbox each guest name has a loopback forward
whose port never changes (sandbox/forward.py); hosts reached directly are listed by the guests'
current addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from pgcarve.control.fleet import Fleet, Instance
from pgcarve.naming import instance_name, standby_name
from pgcarve.postgres import conninfo
from pgcarve.postgres.session import APP_DATABASE, APP_USER, ClientTls

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Endpoints:
    """An instance's application URIs, without the password."""

    rw: str  # the primary, wherever it is
    ro: str  # a standby if one answers, else the primary


def guest_names(fleet: Fleet, index: int) -> list[str]:
    """Every name a guest of instance `index` can have: its first primary's, then one per standby
    host (its standbys', then those a member of a lost host is built again under on the other
    standby hosts: control/recovery.py), so a replacement needs no new string."""
    name = instance_name(fleet.config.fleet, index)
    count = max(fleet.config.replication.standbys, len(fleet.config.standby_hosts))
    return [name] + [standby_name(fleet.config.fleet, index, s) for s in range(1, count + 1)]


def instance_hosts(fleet: Fleet, inst: Instance) -> list[tuple[str, int]]:
    """(host, port) of each of the instance's guests, in a fixed order. A sandbox guest name is
    listed by its forward's port even while no guest has that name (the forward then refuses
    and libpq moves on); a guest reached directly is listed while its address is known."""
    guests = {g.name: g for g in inst.guests}
    all_sandbox = all(h.reach == "sandbox" for h in fleet.config.hosts)
    hosts: list[tuple[str, int]] = []
    for name in guest_names(fleet, inst.index):
        guest = guests.get(name)
        sandboxed = fleet.config.host(guest.info.host).reach == "sandbox" if guest else all_sandbox
        if sandboxed:
            hosts.append((LOOPBACK, fleet.forwards.port(name)))
        elif guest is not None and guest.address is not None:
            hosts.append((guest.address, 5432))
    return hosts


def application_uris(hosts: list[tuple[str, int]], tls: ClientTls, password: str | None = None) -> Endpoints:
    """The read-write and read-only URIs of the application role over `hosts`."""
    return Endpoints(
        rw=conninfo.endpoint_uri(APP_USER, APP_DATABASE, hosts, "read-write", tls, password),
        ro=conninfo.endpoint_uri(APP_USER, APP_DATABASE, hosts, "prefer-standby", tls, password),
    )


def instance_endpoints(fleet: Fleet, inst: Instance) -> Endpoints | None:
    """The instance's URIs, or None while none of its guests can be listed."""
    hosts = instance_hosts(fleet, inst)
    return application_uris(hosts, fleet.client_tls) if hosts else None
