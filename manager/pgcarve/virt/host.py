"""One libvirt host, through libvirt-python (the virt package is the only one that imports it).

libvirt.libvirtError is translated here, once, into pgcarve's own errors, with the host's name
and URI in the message (`translate`; `acting` for a change, after the fence: virt/fencing.py).
Everything pgcarve stores about a guest lives in libvirt (domain XML and pgcarve metadata), so
the view built from `guests()` is the truth after any restart. Its pool is `storage`."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import libvirt

from pgcarve.errors import ConfigError, HostUnreachable, LibvirtFailure, NotFound
from pgcarve.planning.topology import HostTopology, parse_capabilities
from pgcarve.virt.dhcp import DhcpSection, host_entry
from pgcarve.virt.domain_xml import (
    CREATING_NS,
    METADATA_NS,
    METADATA_PREFIX,
    DomainSpec,
    InstanceMetadata,
    format_cpuset,
)
from pgcarve.virt.fencing import Fenced
from pgcarve.virt.storage import HostStorage
from pgcarve.virt.xml_specs import NetworkSpec

# libvirt prints every error to stderr by default; we report them ourselves.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)

STATE_NAMES = {
    libvirt.VIR_DOMAIN_NOSTATE: "unknown",
    libvirt.VIR_DOMAIN_RUNNING: "running",
    libvirt.VIR_DOMAIN_BLOCKED: "running",
    libvirt.VIR_DOMAIN_PAUSED: "paused",
    libvirt.VIR_DOMAIN_SHUTDOWN: "shutting-down",
    libvirt.VIR_DOMAIN_SHUTOFF: "shut-off",
    libvirt.VIR_DOMAIN_CRASHED: "crashed",
    libvirt.VIR_DOMAIN_PMSUSPENDED: "suspended",
}


@dataclass(frozen=True)
class GuestInfo:
    """What libvirt says about one pgcarve guest (an immutable snapshot)."""

    name: str
    host: str
    metadata: InstanceMetadata
    state: str
    vcpu_pins: tuple[tuple[int, ...], ...]  # per vCPU, the host CPUs it may run on
    emulator_cpus: tuple[int, ...]
    memory_mib: int
    mac: str | None
    creating: bool = False  # still being built by a scale operation (see domain_xml.CREATING_NS)
    kernel: str = ""  # the kernel it boots (its image version's volume)


DomainFacts = tuple[int, str | None, bool, str]  # vCPUs, MAC, still being created, kernel

_facts: dict[bytes, DomainFacts] = {}
_facts_guard = threading.Lock()
FACTS_KEPT = 16384  # answers remembered (a digest and four fields each): several fleets of thousands


def domain_facts(xml_text: str) -> DomainFacts:
    """What a guest's listing needs from its domain XML: its vCPU count, MAC, "being created"
    mark and kernel. A pure function of libvirt's answer, remembered by the answer's digest: a
    domain that has not changed answers the same text, and parsing every domain's XML again
    was a third of a listing at a thousand guests. Nothing is remembered about a domain itself:
    libvirt's XML is still read every time."""
    key = hashlib.blake2b(xml_text.encode(), digest_size=16).digest()
    with _facts_guard:
        found = _facts.get(key)
    if found is not None:
        return found
    xml = ET.fromstring(xml_text)
    mac_el = xml.find("devices/interface/mac")
    found = (int(xml.findtext("vcpu") or "1"), mac_el.attrib.get("address") if mac_el is not None else None,
             xml.find(f"metadata/{{{CREATING_NS}}}creating") is not None, xml.findtext("os/kernel") or "")
    with _facts_guard:
        if len(_facts) >= FACTS_KEPT:
            _facts.clear()
        _facts[key] = found
    return found


class LibvirtHost(Fenced):
    """A connection to one libvirt host, named as in the hosts file."""

    def __init__(self, name: str, uri: str, pool: str = "pgcarve", pool_path: str = "/var/lib/libvirt/pgcarve"):
        self.name = name
        self.uri = uri
        self._conn: libvirt.virConnect | None = None
        self._lock = threading.Lock()
        self._reserving = threading.Lock()  # two new primaries must not pick the same free address
        self.storage = HostStorage(self, pool, pool_path)

    # -- connection -------------------------------------------------------------------------

    @property
    def conn(self) -> libvirt.virConnect:
        with self._lock:
            if self._conn is None or not self._conn.isAlive():
                try:
                    self._conn = libvirt.open(self.uri)
                except libvirt.libvirtError as exc:
                    raise HostUnreachable(
                        f"host {self.name}: cannot reach libvirt at {self.uri}: {exc.get_error_message()}"
                    ) from None
            return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(libvirt.libvirtError):
                    self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def translate(self, doing: str) -> Iterator[None]:
        """Turn a libvirtError raised inside into pgcarve's error for it, naming the host."""
        try:
            yield
        except libvirt.libvirtError as exc:
            code = exc.get_error_code()
            if code in (libvirt.VIR_ERR_NO_DOMAIN, libvirt.VIR_ERR_NO_STORAGE_VOL,
                        libvirt.VIR_ERR_NO_NETWORK, libvirt.VIR_ERR_NO_STORAGE_POOL):
                raise NotFound(f"host {self.name}: {doing}: {exc.get_error_message()}") from None
            if code in (libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_ERR_RPC) and not self._alive():
                self._conn = None  # reconnect on the next call (e.g. libvirtd was restarted)
                raise HostUnreachable(f"host {self.name}: lost libvirt at {self.uri} while {doing}") from None
            raise LibvirtFailure(f"host {self.name}: {doing} failed: {exc.get_error_message()}") from None

    def _alive(self) -> bool:
        try:
            return self._conn is not None and self._conn.isAlive() == 1
        except libvirt.libvirtError:
            return False

    def ping(self) -> None:
        with self.translate("checking the connection"):
            self.conn.getLibVersion()

    # -- host facts -------------------------------------------------------------------------

    def capabilities(self) -> str:
        """libvirt's capabilities XML of the host (CPUs, NUMA cells, memory)."""
        with self.translate("reading capabilities"):
            return str(self.conn.getCapabilities())

    def topology(self) -> HostTopology:
        return parse_capabilities(self.capabilities())

    def versions(self) -> dict[str, str]:
        with self.translate("reading versions"):
            conn = self.conn

            def ver(n: int) -> str:
                return f"{n // 1000000}.{n // 1000 % 1000}.{n % 1000}"

            return {"libvirt": ver(conn.getLibVersion()), "hypervisor": ver(conn.getVersion()),
                    "hostname": conn.getHostname()}

    # -- guests -----------------------------------------------------------------------------

    def define_and_start(self, spec: DomainSpec) -> None:
        """Define the guest and start it. Not autostarted with libvirtd: after a host comes back,
        the manager decides what each of its guests becomes (a primary that was failed over
        elsewhere must not start as a second primary)."""
        with self.acting(f"defining and starting {spec.name}"):
            dom = self.conn.defineXML(spec.to_xml())
            dom.setAutostart(0)
            dom.create()

    def define(self, spec: DomainSpec) -> None:
        """Define the guest without starting it (not autostarted either)."""
        with self.acting(f"defining {spec.name}"):
            self.conn.defineXML(spec.to_xml()).setAutostart(0)

    def stop(self, name: str) -> bool:
        """Power a guest off at once, keeping its definition and disks; False if it was not running."""
        with self.acting(f"stopping {name}"):
            dom = self.conn.lookupByName(name)
            dom.setAutostart(0)
            if not dom.isActive():
                return False
            dom.destroy()
            return True

    def start(self, name: str) -> None:
        with self.acting(f"starting {name}"):
            dom = self.conn.lookupByName(name)
            if not dom.isActive():
                dom.create()

    def destroy(self, name: str, undefine: bool = True) -> bool:
        """Stop a guest at once (power off) and, by default, forget its definition."""
        with self.acting(f"removing {name}"):
            try:
                dom = self.conn.lookupByName(name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    return False
                raise
            if dom.isActive():
                dom.destroy()
            if undefine:
                dom.undefine()  # direct kernel boot: no NVRAM to remove
            return True

    def shutdown(self, name: str, timeout_s: float = 60.0) -> None:
        """Ask the guest to power off cleanly (ACPI), forcing it after timeout_s."""
        with self.acting(f"shutting down {name}"):
            dom = self.conn.lookupByName(name)
            if not dom.isActive():
                return
            dom.shutdown()
            deadline = time.monotonic() + timeout_s
            while dom.isActive() and time.monotonic() < deadline:
                time.sleep(0.5)
            if dom.isActive():
                dom.destroy()

    def guests(self, fleet: str | None = None, named: Callable[[str], bool] | None = None) -> list[GuestInfo]:
        """Every domain carrying pgcarve metadata (of one fleet, if given), sorted by name; with
        `named`, only domains whose name it accepts are read (a name is known without asking
        libvirtd again, the rest of a guest's facts take several calls)."""
        try:
            return self._list_guests(fleet, named)
        except HostUnreachable:
            # Without an event loop, a connection closed by a libvirtd restart is noticed only
            # by the next call. Listing changes nothing: once more, on a fresh connection.
            return self._list_guests(fleet, named)

    def _list_guests(self, fleet: str | None, named: Callable[[str], bool] | None) -> list[GuestInfo]:
        with self.translate("listing guests"):
            found = []
            for dom in self.conn.listAllDomains(0):
                if named is not None and not named(dom.name()):
                    continue
                try:
                    info = self._guest_info(dom)
                except libvirt.libvirtError as exc:
                    if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                        continue  # removed while we were listing: it is simply not there any more
                    raise
                if info is not None and (fleet is None or info.metadata.fleet == fleet):
                    found.append(info)
            return sorted(found, key=lambda g: g.name)

    def defined(self, name: str) -> bool:
        """Does any domain (pgcarve's or not) of this name exist here?"""
        with self.translate(f"looking up {name}"):
            try:
                self.conn.lookupByName(name)
                return True
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    return False
                raise

    def guest(self, name: str) -> GuestInfo:
        with self.translate(f"looking up {name}"):
            info = self._guest_info(self.conn.lookupByName(name))
        if info is None:
            raise NotFound(f"host {self.name}: domain {name} is not a pgcarve guest")
        return info

    def _guest_info(self, dom: libvirt.virDomain) -> GuestInfo | None:
        try:
            meta_xml = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS, 0)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() in (libvirt.VIR_ERR_NO_DOMAIN_METADATA, libvirt.VIR_ERR_NO_DOMAIN):
                return None
            raise
        metadata = InstanceMetadata.from_element(ET.fromstring(meta_xml))
        state, _reason = dom.state()
        ncpus, mac, creating, kernel = domain_facts(dom.XMLDesc(0))
        # Pinning as libvirt applies it (virDomainGetVcpuPinInfo), not as we wrote it.
        pin_info = dom.vcpuPinInfo(libvirt.VIR_DOMAIN_AFFECT_CURRENT)
        pins = tuple(tuple(i for i, on in enumerate(row) if on) for row in pin_info[:ncpus])
        emulator = dom.emulatorPinInfo(libvirt.VIR_DOMAIN_AFFECT_CURRENT)
        emulator_cpus = tuple(i for i, on in enumerate(emulator) if on) if emulator else ()
        return GuestInfo(
            name=dom.name(),
            host=self.name,
            metadata=metadata,
            state=STATE_NAMES.get(state, "unknown"),
            vcpu_pins=pins,
            emulator_cpus=emulator_cpus,
            memory_mib=dom.maxMemory() // 1024,
            mac=mac,
            creating=creating,
            kernel=kernel,
        )

    def _affect(self, dom: libvirt.virDomain) -> int:
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
        return flags | libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else flags

    def mark_complete(self, name: str) -> None:
        """Drop the "being created" marker: the guest's instance is whole."""
        with self.acting(f"marking {name} complete"):
            dom = self.conn.lookupByName(name)
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, None, None, CREATING_NS, self._affect(dom))

    def set_metadata(self, name: str, metadata: InstanceMetadata) -> None:
        """Give a guest a new pgcarve identity (a standby promoted to primary)."""
        with self.acting(f"updating {name}'s metadata"):
            dom = self.conn.lookupByName(name)
            flags = self._affect(dom)
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, metadata.to_set_metadata(), METADATA_PREFIX,
                            METADATA_NS, flags)
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_TITLE, f"pgcarve {metadata.role} {name}", None, None, flags)

    def disk_errors(self, name: str) -> dict[str, str]:
        """Disks of a guest that QEMU stopped on an I/O error: device -> "no space" / "I/O error"."""
        with self.translate(f"reading {name}'s disk errors"):
            errors = self.conn.lookupByName(name).diskErrors(0) or {}
        words = {libvirt.VIR_DOMAIN_DISK_ERROR_NO_SPACE: "no space left",
                 libvirt.VIR_DOMAIN_DISK_ERROR_UNSPEC: "I/O error"}
        return {dev: words[code] for dev, code in errors.items() if code in words}

    def reserve_address(self, network: str, mac: str) -> str | None:
        """A fixed DHCP address for `mac` on `network` (live and persistent, see virt/dhcp.py):
        the one it has if it has one, else a free one; None when the network has no DHCP range
        or no free address in it."""
        with self._reserving, self.translate(f"reserving an address on network {network}"):
            net = self.conn.networkLookupByName(network)
            section = DhcpSection.parse(net.XMLDesc(0))
            if section is None:
                return None
            if mac.lower() in section.hosts:
                return section.hosts[mac.lower()]
            address = section.choose(self._leased(net))
            if address is not None:
                self._update_dhcp_hosts(net, libvirt.VIR_NETWORK_UPDATE_COMMAND_ADD_LAST, host_entry(mac, address))
            return address

    @staticmethod
    def _leased(net: libvirt.virNetwork) -> set[str]:
        """Addresses the network's dnsmasq has handed out (none known: a driver without leases)."""
        try:
            return {str(lease["ipaddr"]) for lease in net.DHCPLeases() if lease.get("ipaddr")}
        except libvirt.libvirtError:
            return set()

    @staticmethod
    def _update_dhcp_hosts(net: libvirt.virNetwork, command: int, entry: str) -> None:
        """Change the network's DHCP host entries persistently, and live when it runs."""
        flags = libvirt.VIR_NETWORK_UPDATE_AFFECT_CONFIG
        if net.isActive():
            flags |= libvirt.VIR_NETWORK_UPDATE_AFFECT_LIVE
        net.update(command, libvirt.VIR_NETWORK_SECTION_IP_DHCP_HOST, -1, entry, flags)

    def release_address(self, network: str, mac: str) -> None:
        """Drop `mac`'s fixed address on `network`, if it has one (its guest is gone for good)."""
        with self._reserving, self.translate(f"releasing {mac}'s address on network {network}"):
            net = self.conn.networkLookupByName(network)
            section = DhcpSection.parse(net.XMLDesc(0))
            if section is not None and mac.lower() in section.hosts:
                self._update_dhcp_hosts(net, libvirt.VIR_NETWORK_UPDATE_COMMAND_DELETE, host_entry(mac))

    def guest_address(self, name: str, network: str, mac: str | None) -> str | None:
        """The guest's IPv4 address from the libvirt network's DHCP leases, if it has one yet.

        The newest lease wins: a guest re-created under the same name (same MAC) boots with a new
        machine-id, so dnsmasq may give it a new address while the old lease is still listed.
        """
        with self.translate(f"reading {name}'s address"):
            try:
                leases = self.conn.networkLookupByName(network).DHCPLeases(mac, 0) if mac else []
            except libvirt.libvirtError:
                leases = []
            ipv4 = [lease for lease in leases if lease.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4]
            if ipv4:
                return str(max(ipv4, key=lambda lease: lease.get("expirytime", 0))["ipaddr"])
            # Not a libvirt-managed DHCP network: ask the domain (lease source) instead.
            try:
                ifaces = self.conn.lookupByName(name).interfaceAddresses(
                    libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE, 0)
            except libvirt.libvirtError:
                ifaces = {}
            for iface in (ifaces or {}).values():
                for addr in iface.get("addrs") or []:
                    if addr.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4:
                        return str(addr["addr"])
            return None

    def power_off_everything(self) -> None:
        """Destroy every running domain and network on this host, pgcarve's or not: only for
        tearing down a sandbox host, whose every guest pgcarve started."""
        with self.translate("powering off every guest and network"):
            for dom in self.conn.listAllDomains(0):
                with contextlib.suppress(libvirt.libvirtError):
                    if dom.isActive():
                        dom.destroy()
            for net in self.conn.listAllNetworks(0):
                with contextlib.suppress(libvirt.libvirtError):
                    if net.isActive():
                        net.destroy()

    # -- networks ----------------------------------------------------------------------------

    def dhcp_range(self, network: str) -> tuple[str, str, str]:
        """(the network's IPv4 subnet as a CIDR, first and last address of its DHCP range), as
        libvirt defines it; ConfigError when the network has no IPv4 DHCP range."""
        with self.translate(f"reading network {network}"):
            try:
                section = DhcpSection.parse(self.conn.networkLookupByName(network).XMLDesc(0))
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_NETWORK:
                    raise ConfigError(f"host {self.name} has no libvirt network {network!r}") from None
                raise
        if section is None:
            raise ConfigError(f"network {network} on host {self.name} has no IPv4 DHCP range: pgcarve's guests "
                              "take their addresses from it")
        return str(section.subnet), str(section.first), str(section.last)

    # -- the sandbox's networks ------------------------------------------------------------

    def ensure_network(self, spec: NetworkSpec) -> None:
        """The network defined, autostarted and running (left as it is if it exists)."""
        with self.translate(f"preparing network {spec.name}"):
            try:
                net = self.conn.networkLookupByName(spec.name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_NETWORK:
                    raise
                net = self.conn.networkDefineXML(spec.to_xml())
                net.setAutostart(1)
            if not net.isActive():
                net.create()


def cpuset_text(pins: tuple[tuple[int, ...], ...]) -> str:
    return format_cpuset(c for row in pins for c in row)





