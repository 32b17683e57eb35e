"""A small typed model of the libvirt domain pgcarve creates, rendered with ElementTree.

Only validated values reach the XML, and ElementTree escapes text and attributes, so no user
value is ever pasted into markup. Element order is fixed, so the same spec always renders the
same XML (the golden files in tests/data/domain_xml/ rely on it).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pgcarve.errors import ConfigError
from pgcarve.planning.topology import format_cpuset, parse_cpuset

METADATA_NS = "urn:pgcarve:instance:1"
METADATA_PREFIX = "pgcarve"
ET.register_namespace(METADATA_PREFIX, METADATA_NS)
# Present only while the manager is still building a guest's instance: a guest that carries it
# after a manager crash is half-made and is removed on restart (it never held acknowledged data).
CREATING_NS = "urn:pgcarve:creating:1"
CREATING_PREFIX = "pgcarve-creating"
ET.register_namespace(CREATING_PREFIX, CREATING_NS)

FLEET_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
DOMAIN_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
MAC_RE = re.compile(r"^52:54:00(:[0-9a-f]{2}){3}$")
IDENT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
DomainType = Literal["kvm", "qemu"]
Role = Literal["primary", "standby"]
CreatedBy = Literal["manager", "terraform"]
Roles = Literal["manager", "patroni"]  # who decides the instance's roles (replication.roles)
# A domain without the attribute was made by a release before it existed, under the manager's roles
# (their default; only test fleets ran Patroni then).
EARLIER_ROLES: Roles = "manager"


@dataclass(frozen=True)
class InstanceMetadata:
    """pgcarve's identity for a domain, stored in <metadata> under METADATA_NS.

    libvirt is the source of truth: a restarted manager rebuilds its whole view from these.
    """

    fleet: str
    cluster: str  # the primary's name; a primary and its standbys share it
    role: Role
    index: int  # instance number, 1-based; scale-down removes the highest first
    standby: int = 0  # 0 for the primary, 1.. for standbys in sync priority order
    created_by: CreatedBy = "manager"
    roles: Roles = EARLIER_ROLES  # who decides roles in the instance the guest was made for

    def __post_init__(self) -> None:
        if not FLEET_RE.fullmatch(self.fleet):
            raise ConfigError(
                f"fleet name {self.fleet!r} must be 1-16 lower-case letters/digits, starting with a letter"
            )
        if not DOMAIN_NAME_RE.fullmatch(self.cluster):
            raise ConfigError(f"cluster name {self.cluster!r} is not a valid instance name")
        if self.role not in ("primary", "standby"):
            raise ConfigError(f"role {self.role!r} must be primary or standby")
        if self.index < 1 or self.standby < 0 or (self.role == "standby") != (self.standby > 0):
            raise ConfigError(f"inconsistent instance numbering: index {self.index}, standby {self.standby}")
        if self.roles not in ("manager", "patroni"):
            raise ConfigError(f"roles {self.roles!r} must be manager or patroni")

    def element(self) -> ET.Element:
        return ET.Element(
            f"{{{METADATA_NS}}}instance",
            {
                "fleet": self.fleet,
                "cluster": self.cluster,
                "role": self.role,
                "index": str(self.index),
                "standby": str(self.standby),
                "created-by": self.created_by,
                "roles": self.roles,
            },
        )

    def to_set_metadata(self) -> str:
        """The element for virDomainSetMetadata: unqualified, because libvirt adds the namespace
        from its key/uri arguments and refuses an element that already declares the prefix."""
        element = self.element()
        element.tag = "instance"
        return ET.tostring(element, encoding="unicode")

    @classmethod
    def from_element(cls, element: ET.Element) -> InstanceMetadata:
        try:
            return cls(
                fleet=element.attrib["fleet"],
                cluster=element.attrib["cluster"],
                role=element.attrib["role"],  # type: ignore[arg-type]  # validated in __post_init__
                index=int(element.attrib["index"]),
                standby=int(element.attrib.get("standby", "0")),
                created_by=element.attrib.get("created-by", "manager"),  # type: ignore[arg-type]
                roles=element.attrib.get("roles", EARLIER_ROLES),  # type: ignore[arg-type]  # validated too
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"pgcarve metadata is incomplete or malformed: {exc}") from None

    @classmethod
    def from_domain_xml(cls, domain_xml: str) -> InstanceMetadata | None:
        """The metadata in a full domain XML, or None if the domain is not pgcarve's."""
        root = ET.fromstring(domain_xml)
        found = root.find(f"metadata/{{{METADATA_NS}}}instance")
        return None if found is None else cls.from_element(found)


@dataclass(frozen=True)
class Disk:
    target: str  # vda, vdb, ...
    pool: str
    volume: str
    format: Literal["qcow2", "raw"] = "qcow2"
    readonly: bool = False
    cache: Literal["none", "writeback", "writethrough", "directsync", "unsafe"] = "none"

    def element(self) -> ET.Element:
        disk = ET.Element("disk", {"type": "volume", "device": "disk"})
        ET.SubElement(disk, "driver", {"name": "qemu", "type": self.format, "cache": self.cache})
        ET.SubElement(disk, "source", {"pool": self.pool, "volume": self.volume})
        ET.SubElement(disk, "target", {"dev": self.target, "bus": "virtio"})
        if self.readonly:
            ET.SubElement(disk, "readonly")
        return disk


@dataclass(frozen=True)
class Nic:
    network: str
    mac: str

    def element(self) -> ET.Element:
        nic = ET.Element("interface", {"type": "network"})
        ET.SubElement(nic, "mac", {"address": self.mac})
        ET.SubElement(nic, "source", {"network": self.network})
        ET.SubElement(nic, "model", {"type": "virtio"})
        return nic


@dataclass(frozen=True)
class DomainSpec:
    """Everything pgcarve decides about one guest."""

    name: str
    domain_type: DomainType
    metadata: InstanceMetadata
    memory_mib: int
    vcpu_pins: tuple[int, ...]  # vCPU k runs on host CPU vcpu_pins[k]
    emulator_cpus: tuple[int, ...]
    kernel: str
    initrd: str
    disks: tuple[Disk, ...]
    nics: tuple[Nic, ...]
    numa_node: int | None = None
    hugepages: bool = False
    console_log: str | None = None
    cmdline: str = "root=/dev/vda rw console=ttyS0 quiet systemd.show_status=0"
    machine: str = "pc"
    title: str = field(default="")
    creating: bool = False  # mark as half-made until the instance is complete (CREATING_NS)

    def __post_init__(self) -> None:
        if not DOMAIN_NAME_RE.fullmatch(self.name):
            raise ConfigError(f"domain name {self.name!r} is invalid (lower-case letters, digits, '-')")
        if self.domain_type not in ("kvm", "qemu"):
            raise ConfigError(f"domain type {self.domain_type!r} must be kvm or qemu")
        if not self.vcpu_pins:
            raise ConfigError(f"{self.name}: at least one vCPU is needed")
        if len(set(self.vcpu_pins)) != len(self.vcpu_pins):
            raise ConfigError(f"{self.name}: two vCPUs pinned to the same host CPU {self.vcpu_pins}")
        if any(c < 0 for c in (*self.vcpu_pins, *self.emulator_cpus)):
            raise ConfigError(f"{self.name}: host CPU ids must be >= 0")
        if not 128 <= self.memory_mib <= 4 * 1024 * 1024:
            raise ConfigError(f"{self.name}: memory {self.memory_mib} MiB is outside 128 MiB..4 TiB")
        for nic in self.nics:
            if not MAC_RE.fullmatch(nic.mac):
                raise ConfigError(f"{self.name}: MAC {nic.mac!r} is not a 52:54:00:xx:xx:xx address")
            if not IDENT_RE.fullmatch(nic.network):
                raise ConfigError(f"{self.name}: network name {nic.network!r} is invalid")
        for disk in self.disks:
            if not (IDENT_RE.fullmatch(disk.pool) and IDENT_RE.fullmatch(disk.volume)):
                raise ConfigError(f"{self.name}: pool/volume name {disk.pool}/{disk.volume} is invalid")
            if not re.fullmatch(r"vd[a-z]", disk.target):
                raise ConfigError(f"{self.name}: disk target {disk.target!r} must be vda..vdz")

    def to_xml(self) -> str:
        """The domain XML for virDomainDefineXML (deterministic, pretty-printed)."""
        dom = ET.Element("domain", {"type": self.domain_type})
        ET.SubElement(dom, "name").text = self.name
        ET.SubElement(dom, "title").text = self.title or f"pgcarve {self.metadata.role} {self.name}"
        metadata = ET.SubElement(dom, "metadata")
        metadata.append(self.metadata.element())
        if self.creating:
            metadata.append(ET.Element(f"{{{CREATING_NS}}}creating"))
        ET.SubElement(dom, "memory", {"unit": "MiB"}).text = str(self.memory_mib)
        ET.SubElement(dom, "currentMemory", {"unit": "MiB"}).text = str(self.memory_mib)
        if self.hugepages:
            ET.SubElement(ET.SubElement(dom, "memoryBacking"), "hugepages")
        ET.SubElement(dom, "vcpu", {"placement": "static"}).text = str(len(self.vcpu_pins))
        cputune = ET.SubElement(dom, "cputune")
        for vcpu, host_cpu in enumerate(self.vcpu_pins):
            ET.SubElement(cputune, "vcpupin", {"vcpu": str(vcpu), "cpuset": str(host_cpu)})
        ET.SubElement(cputune, "emulatorpin", {"cpuset": format_cpuset(self.emulator_cpus)})
        if self.numa_node is not None:
            numatune = ET.SubElement(dom, "numatune")
            ET.SubElement(numatune, "memory", {"mode": "strict", "nodeset": str(self.numa_node)})
        os_el = ET.SubElement(dom, "os")
        ET.SubElement(os_el, "type", {"arch": "x86_64", "machine": self.machine}).text = "hvm"
        ET.SubElement(os_el, "kernel").text = self.kernel
        ET.SubElement(os_el, "initrd").text = self.initrd
        ET.SubElement(os_el, "cmdline").text = self.cmdline
        features = ET.SubElement(dom, "features")
        ET.SubElement(features, "acpi")
        ET.SubElement(features, "apic")
        if self.domain_type == "kvm":
            ET.SubElement(dom, "cpu", {"mode": "host-passthrough", "check": "none"})
        ET.SubElement(dom, "clock", {"offset": "utc"})
        ET.SubElement(dom, "on_poweroff").text = "destroy"
        ET.SubElement(dom, "on_reboot").text = "restart"
        ET.SubElement(dom, "on_crash").text = "destroy"
        devices = ET.SubElement(dom, "devices")
        for disk in self.disks:
            devices.append(disk.element())
        for nic in self.nics:
            devices.append(nic.element())
        serial = ET.SubElement(devices, "serial", {"type": "pty"})
        if self.console_log:
            ET.SubElement(serial, "log", {"file": self.console_log, "append": "off"})
        ET.SubElement(serial, "target", {"port": "0"})
        channel = ET.SubElement(devices, "channel", {"type": "unix"})
        ET.SubElement(channel, "target", {"type": "virtio", "name": "org.qemu.guest_agent.0"})
        rng = ET.SubElement(devices, "rng", {"model": "virtio"})
        ET.SubElement(rng, "backend", {"model": "random"}).text = "/dev/urandom"
        # A hardware watchdog the guest's Patroni arms while it is the leader: a primary whose Patroni
        # stops renewing (a hung guest) is reset before its leader key runs out (ttl - safety margin).
        ET.SubElement(devices, "watchdog", {"model": "i6300esb", "action": "reset"})
        ET.SubElement(devices, "memballoon", {"model": "none"})
        ET.indent(dom)
        return ET.tostring(dom, encoding="unicode") + "\n"


def mac_for(fleet: str, name: str) -> str:
    """A stable locally administered MAC for a guest (same name -> same MAC)."""
    import hashlib

    digest = hashlib.sha256(f"{fleet}/{name}".encode()).digest()
    return "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])


def vcpu_pins_from_xml(domain_xml: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(vcpu pins, emulator cpus) as written in a domain XML (for domains not running)."""
    root = ET.fromstring(domain_xml)
    pins: dict[int, int] = {}
    for pin in root.findall("cputune/vcpupin"):
        cpus = parse_cpuset(pin.attrib["cpuset"])
        pins[int(pin.attrib["vcpu"])] = cpus[0]
    emulator = root.find("cputune/emulatorpin")
    emulator_cpus = parse_cpuset(emulator.attrib["cpuset"]) if emulator is not None else ()
    return tuple(pins[k] for k in sorted(pins)), emulator_cpus


def summarize(cpus: Sequence[int]) -> str:
    return format_cpuset(cpus) or "-"
