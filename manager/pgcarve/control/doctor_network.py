"""`pgcarve doctor`'s network checks: each host's libvirt network, this machine's route to its
guests, and guest subnets that must not overlap.

This machine's routes are only looked up (`ip route get`, a routing-table query over netlink):
no packet is sent anywhere. Routes between the hosts are not visible over libvirt, and are
reported as not checked.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from pgcarve.config import FleetConfig, HostConfig
from pgcarve.control.doctor_report import FLEET, NOT_CHECKED, Finding, plural
from pgcarve.errors import ConfigError
from pgcarve.virt.facts import network_facts
from pgcarve.virt.host import LibvirtHost

Subnet = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Route:
    """How this machine would send to an address, as its routing table says (nothing is sent)."""

    found: bool | None  # None: the lookup itself could not be made
    detail: str  # "via 192.0.2.1 dev eth0", or why there is no route
    default_only: bool = False  # only the default route covers the address


def lookup_route(address: str) -> Route:
    """`ip route get` and whether a route more specific than the default covers the address
    (`ip route show match`): both only read the routing table."""
    try:
        got = subprocess.run(["ip", "-j", "route", "get", address], capture_output=True, text=True,
                             timeout=10, check=False)
        if got.returncode != 0:
            return Route(False, got.stderr.strip() or f"ip route get exited with {got.returncode}")
        route = json.loads(got.stdout)[0]
        matching = subprocess.run(["ip", "-j", "route", "show", "match", address], capture_output=True,
                                  text=True, timeout=10, check=False)
        covering = [r.get("dst") for r in json.loads(matching.stdout or "[]")]
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return Route(None, f"`ip route` could not be asked ({exc})")
    if route.get("type") in ("unreachable", "blackhole", "prohibit"):
        return Route(False, f"a route of type {route['type']}")
    detail = " ".join(f"{word} {route[key]}" for key, word in (("gateway", "via"), ("dev", "dev")) if key in route)
    return Route(True, detail, default_only=bool(covering) and all(dst == "default" for dst in covering))


@dataclass(frozen=True)
class NetworkChecks:
    """The checks of one host's network, for a scale to `instances` (None: no plan to compare with)."""

    config: FleetConfig
    route: Callable[[str], Route]
    instances: int | None

    def check(self, host: HostConfig, lv: LibvirtHost, planned: list[int] | None,
              subnets: dict[str, tuple[HostConfig, Subnet]]) -> list[Finding]:
        """The network's findings; a host reached directly adds its guest subnet to `subnets`."""
        name = host.network
        facts = network_facts(lv, name)
        if facts is None:
            return [Finding(host.name, "network", "fail", (
                f"network {name} is not defined on {host.name}: guests attach to it; define a libvirt network with "
                "an IPv4 DHCP range, routed to the other hosts and this machine (`virsh net-define`), then "
                f"`virsh net-start {name}` and `virsh net-autostart {name}`"))]
        if not facts.active:
            return [Finding(host.name, "network", "fail", (
                f"network {name} on {host.name} is not active: libvirt starts no guest on it; "
                f"`virsh net-start {name}` and `virsh net-autostart {name}`"))]
        try:
            subnet, first, last = lv.dhcp_range(name)
        except ConfigError:
            return [Finding(host.name, "network", "fail", (
                f"network {name} on {host.name} has no IPv4 DHCP range: guests take their addresses from it "
                "(new primaries and Terraform's guests have theirs reserved from its end); add "
                f"<dhcp><range start=... end=.../></dhcp> to its IPv4 <ip> (`virsh net-edit {name}`)"))]
        findings = [self._dhcp(host, subnet, first, last, planned)]
        # Guests are reached from elsewhere when they replicate, or when the manager is not on their host.
        remote = urlsplit(host.uri).hostname not in (None, "", "localhost")
        if (host.reach == "direct" and facts.forward in (None, "nat")
                and (self.config.replication.standbys > 0 or remote)):
            findings.append(Finding(host.name, "network", "fail", (
                f"network {name} on {host.name} accepts no connections from other machines (forward mode "
                f"{facts.forward or 'none: isolated'}): libvirt lets only replies in, so standbys on other hosts "
                "(and the manager, unless it runs there) cannot reach its guests; use forward mode route or open, "
                f"and route {subnet} to {host.name}")))
        if not facts.autostart:
            findings.append(Finding(host.name, "network", "warn", (
                f"network {name} on {host.name} does not start with libvirtd: after the host reboots no guest starts "
                f"there until `virsh net-start {name}`; `virsh net-autostart {name}`")))
        if host.reach == "sandbox":
            findings.append(Finding(host.name, "route", "ok", (
                f"reach: sandbox: `pgcarve sandbox up` wires {host.name}'s guest network and this machine's "
                "forwards to its guests")))
            return findings
        subnets[host.name] = (host, ipaddress.ip_network(subnet))
        findings.append(self._route(host, subnet, first))
        return findings

    def _dhcp(self, host: HostConfig, subnet: str, first: str, last: str, planned: list[int] | None) -> Finding:
        size = int(ipaddress.ip_address(last)) - int(ipaddress.ip_address(first)) + 1
        addresses = "1 address" if size == 1 else f"{size} addresses"
        hands = f"network {host.network} on {host.name} hands out {first}-{last} ({addresses})"
        if planned is None or self.instances is None:
            return Finding(host.name, "network", "ok", f"{hands} in {subnet} (not compared with a plan)")
        here, highest = len(planned), max(planned, default=0)
        widen = f"widen the DHCP range (`virsh net-edit {host.network}`)"
        if size < here:
            return Finding(host.name, "network", "fail", (
                f"{hands}, fewer than the {plural(here, 'guest')} that a scale to {self.instances} puts there: "
                f"{widen}"))
        if size < highest:
            return Finding(host.name, "network", "warn", (
                f"{hands}: enough for its {plural(here, 'guest')}, but Terraform reserves instance i the i-th "
                f"address counted down from the range's end, and instance {highest} has a guest here: if Terraform "
                f"lays out this host, {widen} to at least {highest} addresses"))
        return Finding(host.name, "network", "ok", (
            f"{hands} in {subnet}; a scale to {self.instances} needs {highest} (Terraform gives instance i the "
            "i-th address from the end)"))

    def _route(self, host: HostConfig, subnet: str, address: str) -> Finding:
        route = self.route(address)
        add = f"`ip route add {subnet} via <{host.name}'s address>`"
        if route.found is None:
            return Finding(host.name, "route", "warn",
                           f"the route to {host.name}'s guest subnet {subnet} is not checked: {route.detail}")
        if not route.found:
            return Finding(host.name, "route", "fail", (
                f"this machine has no route to {host.name}'s guest subnet {subnet}: `ip route get {address}` says "
                f"{route.detail!r}, and the manager connects to each guest's PostgreSQL at its address; add a "
                f"route, e.g. {add}"))
        if route.default_only:
            return Finding(host.name, "route", "warn", (
                f"only the default route ({route.detail}) leads to {host.name}'s guest subnet {subnet}: the manager "
                f"reaches its guests only if that gateway routes {subnet} to {host.name}; a route of its own is "
                f"clearer: {add}"))
        return Finding(host.name, "route", "ok", (
            f"this machine routes {host.name}'s guest subnet {subnet} {route.detail} (looked up, nothing sent)"))


def subnet_findings(config: FleetConfig, subnets: Mapping[str, tuple[HostConfig, Subnet]]) -> list[Finding]:
    """Hosts reached directly need guest subnets of their own: this machine routes each subnet to
    one place, and an instance's guests on two hosts must tell each other's addresses from their
    own. Two host entries on one libvirt network (same URI and name) are one network."""
    found = []
    items = list(subnets.items())
    for i, (name, (host, net)) in enumerate(items):
        for other, (other_host, other_net) in items[:i]:
            if (host.uri, host.network) != (other_host.uri, other_host.network) and net.overlaps(other_net):
                found.append(Finding(name, "subnets", "fail", (
                    f"guest subnet {net} of {name} overlaps {other}'s {other_net}: this machine and the guests of "
                    "either host send such addresses to one place only, so replication and the manager's "
                    "connections miss the other's guests; give each host's network a subnet of its own")))
    if len(items) > 1 and config.replication.standbys > 0:
        listed = ", ".join(f"{name} {net}" for name, (_, net) in items)
        found.append(Finding(FLEET, "subnets", "warn", (
            f"routes between hosts {NOT_CHECKED} (the hosts' routing tables are not visible through it): each host "
            f"must route the others' guest subnets ({listed}), as standbys connect to their primary's address")))
    return found
