"""A libvirt network's DHCP range, and fixed addresses in it, chosen for a guest's MAC before it boots.

A new primary's address is reserved (a `<host mac=... ip=...>` entry in the network's DHCP
section, which libvirt hands to its dnsmasq) so that its standbys can be started at the same time,
their seeds already naming it (control/provisioning.py). Reserved addresses are counted down from
the end of the DHCP range, the same end Terraform's guests take theirs from (tfvars.py); an address
held by any entry or any current lease is never chosen.
"""

from __future__ import annotations

import ipaddress
import xml.etree.ElementTree as ET
from dataclasses import dataclass


@dataclass(frozen=True)
class DhcpSection:
    """The IPv4 DHCP part of one libvirt network's XML."""

    subnet: ipaddress.IPv4Network
    first: ipaddress.IPv4Address
    last: ipaddress.IPv4Address
    hosts: dict[str, str]  # MAC (lower case) -> reserved address

    @classmethod
    def parse(cls, network_xml: str) -> DhcpSection | None:
        """None when the network has no IPv4 DHCP range (nothing can be reserved there)."""
        for ip in ET.fromstring(network_xml).findall("ip"):
            found = ip.find("dhcp/range")
            if ip.get("family", "ipv4") != "ipv4" or found is None:
                continue
            prefix = ip.get("prefix") or str(ipaddress.ip_network(f"0.0.0.0/{ip.get('netmask')}").prefixlen)
            hosts = {str(h.get("mac")).lower(): str(h.get("ip"))
                     for h in ip.findall("dhcp/host") if h.get("mac") and h.get("ip")}
            return cls(ipaddress.IPv4Network(f"{ip.get('address')}/{prefix}", strict=False),
                       ipaddress.IPv4Address(found.get("start")), ipaddress.IPv4Address(found.get("end")), hosts)
        return None

    def choose(self, taken: set[str]) -> str | None:
        """The highest address of the range that no entry reserves and that is not in `taken`
        (current leases); None when the range is full."""
        held = set(self.hosts.values()) | taken
        address = self.last
        while address >= self.first:
            if str(address) not in held:
                return str(address)
            address -= 1
        return None


def host_entry(mac: str, address: str | None = None) -> str:
    """The `<host>` element virNetworkUpdate takes: with an address to add, without to delete by MAC."""
    attrs = {"mac": mac.lower()}
    if address is not None:
        attrs["ip"] = address
    return ET.tostring(ET.Element("host", attrs), encoding="unicode")
