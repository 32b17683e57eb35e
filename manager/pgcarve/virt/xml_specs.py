"""Typed models of the other libvirt objects pgcarve defines: its storage pool, a volume (a
qcow2 overlay or an uploaded file), the sandbox's routed network, and the KVM probe's domain.

Like domain_xml.DomainSpec: only validated values, ElementTree escapes the rest, and a fixed
element order so the same spec always renders the same XML (golden files in tests/data/).
"""

from __future__ import annotations

import ipaddress
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Literal

from pgcarve.errors import ConfigError

_IDENT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_PATH_RE = re.compile(r"^/[A-Za-z0-9_.+/-]*$")


def _ident(what: str, value: str) -> None:
    if not _IDENT_RE.fullmatch(value):
        raise ConfigError(f"{what} {value!r} is invalid (letters, digits, '_', '.', '-', at most 128)")


def _path(what: str, value: str) -> None:
    if not _PATH_RE.fullmatch(value) or "/../" in value + "/":
        raise ConfigError(f"{what} {value!r} is not an absolute path of plain characters")


def _render(root: ET.Element) -> str:
    ET.indent(root)
    return ET.tostring(root, encoding="unicode") + "\n"


@dataclass(frozen=True)
class PoolSpec:
    """A directory storage pool (virStoragePoolDefineXML)."""

    name: str
    path: str

    def __post_init__(self) -> None:
        _ident("storage pool name", self.name)
        _path("storage pool path", self.path)

    def to_xml(self) -> str:
        root = ET.Element("pool", {"type": "dir"})
        ET.SubElement(root, "name").text = self.name
        ET.SubElement(ET.SubElement(root, "target"), "path").text = self.path
        return _render(root)


@dataclass(frozen=True)
class VolumeSpec:
    """A volume (virStorageVolCreateXML): a file to upload into, or a qcow2 overlay on a backing
    file (O(1) in the backing file's size)."""

    name: str
    capacity: int
    unit: Literal["bytes", "GiB"] = "bytes"
    format: Literal["qcow2", "raw"] = "raw"
    backing_path: str | None = None  # the backing volume's path: an overlay
    backing_format: Literal["qcow2", "raw"] = "qcow2"

    def __post_init__(self) -> None:
        _ident("volume name", self.name)
        if self.capacity < 0:
            raise ConfigError(f"volume {self.name}: capacity {self.capacity} must be >= 0")
        if self.backing_path is not None:
            _path(f"volume {self.name}: backing file", self.backing_path)

    def to_xml(self) -> str:
        root = ET.Element("volume")
        ET.SubElement(root, "name").text = self.name
        ET.SubElement(root, "capacity", {"unit": self.unit}).text = str(self.capacity)
        ET.SubElement(ET.SubElement(root, "target"), "format", {"type": self.format})
        if self.backing_path is not None:
            backing = ET.SubElement(root, "backingStore")
            ET.SubElement(backing, "path").text = self.backing_path
            ET.SubElement(backing, "format", {"type": self.backing_format})
        return _render(root)


@dataclass(frozen=True)
class NetworkSpec:
    """A routed ("open") network with DHCP: no NAT and no firewall rules (the sandbox's)."""

    name: str
    bridge: str
    address: str
    prefix: int
    dhcp_start: str
    dhcp_end: str

    def __post_init__(self) -> None:
        _ident("network name", self.name)
        if not re.fullmatch(r"[a-z][a-z0-9]{0,14}", self.bridge):
            raise ConfigError(f"bridge name {self.bridge!r} is invalid (lower-case letters and digits, at most 15)")
        try:
            net = ipaddress.ip_network(f"{self.address}/{self.prefix}", strict=False)
            inside = all(ipaddress.ip_address(a) in net for a in (self.dhcp_start, self.dhcp_end))
        except ValueError as exc:
            raise ConfigError(f"network {self.name}: {exc}") from None
        if not inside:
            raise ConfigError(f"network {self.name}: DHCP range {self.dhcp_start}-{self.dhcp_end} is outside {net}")

    def to_xml(self) -> str:
        root = ET.Element("network")
        ET.SubElement(root, "name").text = self.name
        ET.SubElement(root, "forward", {"mode": "open"})
        ET.SubElement(root, "bridge", {"name": self.bridge, "stp": "off", "delay": "0"})
        ip = ET.SubElement(root, "ip", {"address": self.address, "prefix": str(self.prefix)})
        ET.SubElement(ET.SubElement(ip, "dhcp"), "range", {"start": self.dhcp_start, "end": self.dhcp_end})
        return _render(root)


@dataclass(frozen=True)
class ProbeDomainSpec:
    """A transient type='kvm' domain that boots the image's kernel to its banner, then stops
    (rdinit=/bin/false panics at once and panic=-1 powers off)."""

    name: str
    kernel: str
    initrd: str
    memory_mib: int = 256

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,62}", self.name):
            raise ConfigError(f"probe domain name {self.name!r} is invalid")
        _path("probe kernel", self.kernel)
        _path("probe initrd", self.initrd)

    def to_xml(self) -> str:
        root = ET.Element("domain", {"type": "kvm"})
        ET.SubElement(root, "name").text = self.name
        ET.SubElement(root, "memory", {"unit": "MiB"}).text = str(self.memory_mib)
        ET.SubElement(root, "vcpu").text = "1"
        os_el = ET.SubElement(root, "os")
        ET.SubElement(os_el, "type", {"arch": "x86_64", "machine": "pc"}).text = "hvm"
        ET.SubElement(os_el, "kernel").text = self.kernel
        ET.SubElement(os_el, "initrd").text = self.initrd
        ET.SubElement(os_el, "cmdline").text = "console=ttyS0 panic=-1 rdinit=/bin/false"
        ET.SubElement(root, "cpu", {"mode": "host-passthrough", "check": "none"})
        ET.SubElement(root, "on_reboot").text = "destroy"
        devices = ET.SubElement(root, "devices")
        serial = ET.SubElement(devices, "serial", {"type": "pty"})
        ET.SubElement(serial, "target", {"port": "0"})
        return _render(root)
