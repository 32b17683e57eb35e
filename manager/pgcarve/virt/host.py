"""One libvirt host, through libvirt-python: the only module that calls libvirt.

libvirt.libvirtError is translated here, once, into pgcarve's own errors, with the host's name
and URI in the message. Everything pgcarve stores about a guest lives in libvirt (domain XML and
its pgcarve metadata), so the view built by `instances()` is the truth after any restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import libvirt

from pgcarve.errors import GuestNotReady, HostUnreachable, LibvirtFailure, NotFound
from pgcarve.planning.topology import HostTopology, parse_capabilities
from pgcarve.virt.domain_xml import (
    CREATING_NS,
    METADATA_NS,
    METADATA_PREFIX,
    DomainSpec,
    InstanceMetadata,
    format_cpuset,
    parse_cpuset,
)

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


@dataclass(frozen=True)
class BaseImage:
    """The guest image's volumes on one host."""

    disk: str  # volume name of base.qcow2
    kernel_path: str
    initrd_path: str


class LibvirtHost:
    """A connection to one libvirt host, named as in the hosts file."""

    def __init__(self, name: str, uri: str, pool: str = "pgcarve", pool_path: str = "/var/lib/libvirt/pgcarve"):
        self.name = name
        self.uri = uri
        self.pool_name = pool
        self.pool_path = pool_path
        self._conn: libvirt.virConnect | None = None
        self._lock = threading.Lock()
        # libvirt refuses concurrent changes to one pool ("pool has asynchronous jobs"): one
        # storage change at a time per host.
        self._storage_lock = threading.RLock()

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
    def _translate(self, doing: str) -> Iterator[None]:
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
        with self._translate("checking the connection"):
            self.conn.getLibVersion()

    # -- host facts -------------------------------------------------------------------------

    def topology(self) -> HostTopology:
        with self._translate("reading capabilities"):
            return parse_capabilities(self.conn.getCapabilities())

    def versions(self) -> dict[str, str]:
        with self._translate("reading versions"):
            conn = self.conn

            def ver(n: int) -> str:
                return f"{n // 1000000}.{n // 1000 % 1000}.{n % 1000}"

            return {"libvirt": ver(conn.getLibVersion()), "hypervisor": ver(conn.getVersion()),
                    "hostname": conn.getHostname()}

    # -- storage ----------------------------------------------------------------------------

    def ensure_pool(self, refresh: bool = False) -> libvirt.virStoragePool:
        """pgcarve's directory pool, defined, built, started and autostarted if needed."""
        with self._storage_lock, self._translate(f"preparing storage pool {self.pool_name}"):
            try:
                pool = self.conn.storagePoolLookupByName(self.pool_name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_POOL:
                    raise
                root = ET.Element("pool", {"type": "dir"})
                ET.SubElement(root, "name").text = self.pool_name
                ET.SubElement(ET.SubElement(root, "target"), "path").text = self.pool_path
                pool = self.conn.storagePoolDefineXML(ET.tostring(root, encoding="unicode"), 0)
                pool.build(0)
                pool.setAutostart(1)
            if not pool.isActive():
                pool.create(0)
            if refresh:
                pool.refresh(0)
            return pool

    def volume_names(self) -> set[str]:
        with self._storage_lock, self._translate("listing volumes"):
            return set(self.ensure_pool(refresh=True).listVolumes())

    def _upload(self, pool: libvirt.virStoragePool, name: str, source: Path, fmt: str) -> libvirt.virStorageVol:
        size = source.stat().st_size
        root = ET.Element("volume")
        ET.SubElement(root, "name").text = name
        ET.SubElement(root, "capacity", {"unit": "bytes"}).text = str(size)
        ET.SubElement(ET.SubElement(root, "target"), "format", {"type": fmt})
        vol = pool.createXML(ET.tostring(root, encoding="unicode"), 0)
        stream = self.conn.newStream(0)
        try:
            vol.upload(stream, 0, size, 0)
            with source.open("rb") as fh:
                stream.sendAll(lambda _s, nbytes, f: f.read(nbytes), fh)
            stream.finish()
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
            with contextlib.suppress(libvirt.libvirtError):
                vol.delete(0)
            raise
        return vol

    def ensure_base_image(self, image_dir: Path) -> BaseImage:
        """Upload the guest image (qcow2, kernel, initrd) once per image version.

        Volume names carry the image's input hash, so a rebuilt image is uploaded beside the old
        one and existing guests keep their backing file.
        """
        tag = (image_dir / "inputs.sha256").read_text().strip()[:12]
        wanted = {
            f"pgcarve-base-{tag}.qcow2": (image_dir / "base.qcow2", "qcow2"),
            f"pgcarve-vmlinuz-{tag}": (image_dir / "vmlinuz", "raw"),
            f"pgcarve-initrd-{tag}": (image_dir / "initrd.img", "raw"),
        }
        with self._storage_lock, self._translate("uploading the guest image"):
            pool = self.ensure_pool(refresh=True)
            present = set(pool.listVolumes())
            for name, (source, fmt) in wanted.items():
                if name not in present:
                    self._upload(pool, name, source, fmt)
            names = list(wanted)
            return BaseImage(
                disk=names[0],
                kernel_path=pool.storageVolLookupByName(names[1]).path(),
                initrd_path=pool.storageVolLookupByName(names[2]).path(),
            )

    def create_overlay(self, name: str, base_volume: str, size_gib: int) -> None:
        """A qcow2 overlay on the base volume: O(1) in the size of the image."""
        with self._storage_lock, self._translate(f"creating disk {name}"):
            pool = self.ensure_pool()
            base = pool.storageVolLookupByName(base_volume)
            root = ET.Element("volume")
            ET.SubElement(root, "name").text = name
            ET.SubElement(root, "capacity", {"unit": "GiB"}).text = str(size_gib)
            ET.SubElement(ET.SubElement(root, "target"), "format", {"type": "qcow2"})
            backing = ET.SubElement(root, "backingStore")
            ET.SubElement(backing, "path").text = base.path()
            ET.SubElement(backing, "format", {"type": "qcow2"})
            pool.createXML(ET.tostring(root, encoding="unicode"), 0)

    def upload_file(self, name: str, source: Path) -> None:
        with self._storage_lock, self._translate(f"uploading {name}"):
            pool = self.ensure_pool()
            with contextlib.suppress(libvirt.libvirtError):
                pool.storageVolLookupByName(name).delete(0)
            self._upload(pool, name, source, "raw")

    def delete_volume(self, name: str) -> bool:
        """Delete a volume if it exists; True if something was deleted."""
        with self._storage_lock, self._translate(f"deleting volume {name}"):
            pool = self.ensure_pool()
            try:
                vol = pool.storageVolLookupByName(name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_VOL:
                    return False
                raise
            vol.delete(0)
            return True

    # -- guests -----------------------------------------------------------------------------

    def define_and_start(self, spec: DomainSpec) -> None:
        with self._translate(f"defining and starting {spec.name}"):
            dom = self.conn.defineXML(spec.to_xml())
            dom.setAutostart(1)
            dom.create()

    def start(self, name: str) -> None:
        with self._translate(f"starting {name}"):
            dom = self.conn.lookupByName(name)
            if not dom.isActive():
                dom.create()

    def destroy(self, name: str, undefine: bool = True) -> bool:
        """Stop a guest at once (power off) and, by default, forget its definition."""
        with self._translate(f"removing {name}"):
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
        with self._translate(f"shutting down {name}"):
            dom = self.conn.lookupByName(name)
            if not dom.isActive():
                return
            dom.shutdown()
            deadline = time.monotonic() + timeout_s
            while dom.isActive() and time.monotonic() < deadline:
                time.sleep(0.5)
            if dom.isActive():
                dom.destroy()

    def guests(self, fleet: str | None = None) -> list[GuestInfo]:
        """Every domain carrying pgcarve metadata (of one fleet, if given), sorted by name."""
        try:
            return self._list_guests(fleet)
        except HostUnreachable:
            # Without an event loop, a connection closed by a libvirtd restart is noticed only
            # by the next call. Listing changes nothing: once more, on a fresh connection.
            return self._list_guests(fleet)

    def _list_guests(self, fleet: str | None) -> list[GuestInfo]:
        with self._translate("listing guests"):
            found = []
            for dom in self.conn.listAllDomains(0):
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
        with self._translate(f"looking up {name}"):
            try:
                self.conn.lookupByName(name)
                return True
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    return False
                raise

    def guest(self, name: str) -> GuestInfo:
        with self._translate(f"looking up {name}"):
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
        xml = ET.fromstring(dom.XMLDesc(0))
        ncpus = int(xml.findtext("vcpu") or "1")
        # Pinning as libvirt applies it (virDomainGetVcpuPinInfo), not as we wrote it.
        pin_info = dom.vcpuPinInfo(libvirt.VIR_DOMAIN_AFFECT_CURRENT)
        pins = tuple(tuple(i for i, on in enumerate(row) if on) for row in pin_info[:ncpus])
        emulator = dom.emulatorPinInfo(libvirt.VIR_DOMAIN_AFFECT_CURRENT)
        emulator_cpus = tuple(i for i, on in enumerate(emulator) if on) if emulator else ()
        mac_el = xml.find("devices/interface/mac")
        creating = xml.find(f"metadata/{{{CREATING_NS}}}creating") is not None
        return GuestInfo(
            name=dom.name(),
            host=self.name,
            metadata=metadata,
            state=STATE_NAMES.get(state, "unknown"),
            vcpu_pins=pins,
            emulator_cpus=emulator_cpus,
            memory_mib=dom.maxMemory() // 1024,
            mac=mac_el.attrib.get("address") if mac_el is not None else None,
            creating=creating,
        )

    def _affect(self, dom: libvirt.virDomain) -> int:
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG
        return flags | libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else flags

    def mark_complete(self, name: str) -> None:
        """Drop the "being created" marker: the guest's instance is whole."""
        with self._translate(f"marking {name} complete"):
            dom = self.conn.lookupByName(name)
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, None, None, CREATING_NS, self._affect(dom))

    def set_metadata(self, name: str, metadata: InstanceMetadata) -> None:
        """Give a guest a new pgcarve identity (a standby promoted to primary)."""
        with self._translate(f"updating {name}'s metadata"):
            dom = self.conn.lookupByName(name)
            flags = self._affect(dom)
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, metadata.to_set_metadata(), METADATA_PREFIX,
                            METADATA_NS, flags)
            dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_TITLE, f"pgcarve {metadata.role} {name}", None, None, flags)

    def disk_errors(self, name: str) -> dict[str, str]:
        """Disks of a guest that QEMU stopped on an I/O error: device -> "no space" / "I/O error"."""
        with self._translate(f"reading {name}'s disk errors"):
            errors = self.conn.lookupByName(name).diskErrors(0) or {}
        words = {libvirt.VIR_DOMAIN_DISK_ERROR_NO_SPACE: "no space left",
                 libvirt.VIR_DOMAIN_DISK_ERROR_UNSPEC: "I/O error"}
        return {dev: words[code] for dev, code in errors.items() if code in words}

    def pool_free_mib(self) -> int:
        """Free space in pgcarve's storage pool, as the pool's filesystem reports it now."""
        with self._storage_lock, self._translate(f"reading free space of pool {self.pool_name}"):
            pool = self.ensure_pool(refresh=True)
            return int(pool.info()[3] // (1024 * 1024))

    def guest_address(self, name: str, network: str, mac: str | None) -> str | None:
        """The guest's IPv4 address from the libvirt network's DHCP leases, if it has one yet.

        The newest lease wins: a guest re-created under the same name (same MAC) boots with a new
        machine-id, so dnsmasq may give it a new address while the old lease is still listed.
        """
        with self._translate(f"reading {name}'s address"):
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

    # -- networks (sandbox and tests) -------------------------------------------------------

    def ensure_network(self, name: str, bridge: str, address: str, prefix: int,
                       dhcp_start: str, dhcp_end: str) -> None:
        """A routed ("open") libvirt network with DHCP: no NAT and no firewall rules."""
        with self._translate(f"preparing network {name}"):
            try:
                net = self.conn.networkLookupByName(name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_NETWORK:
                    raise
                root = ET.Element("network")
                ET.SubElement(root, "name").text = name
                ET.SubElement(root, "forward", {"mode": "open"})
                ET.SubElement(root, "bridge", {"name": bridge, "stp": "off", "delay": "0"})
                ip = ET.SubElement(root, "ip", {"address": address, "prefix": str(prefix)})
                dhcp = ET.SubElement(ip, "dhcp")
                ET.SubElement(dhcp, "range", {"start": dhcp_start, "end": dhcp_end})
                net = self.conn.networkDefineXML(ET.tostring(root, encoding="unicode"))
                net.setAutostart(1)
            if not net.isActive():
                net.create()

    # -- domain type probe ------------------------------------------------------------------

    def probe_kvm(self, image: BaseImage, timeout_s: float = 15.0) -> tuple[bool, str]:
        """Does a guest really boot under KVM here? Boots the image's kernel in a transient
        type='kvm' domain and watches its serial console for the kernel's banner.

        /dev/kvm alone proves nothing: a paravirtual KVM can refuse -cpu host or hang silently.
        """
        name = "pgcarve-kvm-probe-" + hashlib.sha256(os.urandom(8)).hexdigest()[:8]
        root = ET.Element("domain", {"type": "kvm"})
        ET.SubElement(root, "name").text = name
        ET.SubElement(root, "memory", {"unit": "MiB"}).text = "256"
        ET.SubElement(root, "vcpu").text = "1"
        os_el = ET.SubElement(root, "os")
        ET.SubElement(os_el, "type", {"arch": "x86_64", "machine": "pc"}).text = "hvm"
        ET.SubElement(os_el, "kernel").text = image.kernel_path
        ET.SubElement(os_el, "initrd").text = image.initrd_path
        ET.SubElement(os_el, "cmdline").text = "console=ttyS0 panic=-1 rdinit=/bin/false"
        ET.SubElement(root, "cpu", {"mode": "host-passthrough", "check": "none"})
        ET.SubElement(root, "on_reboot").text = "destroy"
        devices = ET.SubElement(root, "devices")
        serial = ET.SubElement(devices, "serial", {"type": "pty"})
        ET.SubElement(serial, "target", {"port": "0"})
        try:
            dom = self.conn.createXML(ET.tostring(root, encoding="unicode"), 0)
        except libvirt.libvirtError as exc:
            return False, f"KVM guest did not start: {exc.get_error_message()}"
        seen = b""
        try:
            stream = self.conn.newStream(libvirt.VIR_STREAM_NONBLOCK)
            dom.openConsole(None, stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and b"Linux version" not in seen:
                try:
                    chunk = stream.recv(4096)
                except libvirt.libvirtError:
                    break
                if chunk == -2:  # nothing yet
                    time.sleep(0.1)
                    continue
                if not chunk:
                    break
                seen += chunk
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
        finally:
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
        if b"Linux version" in seen:
            return True, "a KVM guest printed its kernel banner"
        return False, f"a KVM guest printed no kernel banner in {timeout_s:.0f} s"


def cpuset_text(pins: tuple[tuple[int, ...], ...]) -> str:
    return format_cpuset(c for row in pins for c in row)


__all__ = ["BaseImage", "GuestInfo", "GuestNotReady", "LibvirtHost", "cpuset_text", "parse_cpuset"]


# -- lifecycle events -----------------------------------------------------------------------------

_event_loop_lock = threading.Lock()
_event_loop_started = False


def start_event_loop() -> None:
    """Run libvirt's default event loop on a daemon thread (once per process).

    Needed for lifecycle events and for noticing a lost connection (keepalive). Connections
    opened before this call get neither, so a long-running manager calls it first.
    """
    global _event_loop_started
    with _event_loop_lock:
        if _event_loop_started:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _event_loop_started = True


@dataclass(frozen=True)
class GuestEvent:
    """A guest stopped or paused without being asked to, as libvirt reported it."""

    host: str
    name: str
    kind: Literal["stopped", "paused"]
    cause: str  # libvirt's reason in words
    at: float  # time.time() when the event arrived


_STOP_CAUSES = {
    libvirt.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN: "the guest powered off",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_DESTROYED: "it was destroyed (forced off)",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_CRASHED: "the guest crashed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_FAILED: "its QEMU process died",
}
_PAUSE_CAUSES = {
    libvirt.VIR_DOMAIN_EVENT_SUSPENDED_IOERROR: "QEMU paused it on a disk I/O error (disk full?)",
    libvirt.VIR_DOMAIN_EVENT_SUSPENDED_WATCHDOG: "QEMU paused it: its watchdog fired",
}


class LifecycleWatch:
    """Follows one host's domain lifecycle events on a connection of its own, reconnecting when
    libvirtd goes away (e.g. restarted). `on_event` gets GuestEvents; `on_connect` is called after
    each (re)connection, when events may have been missed."""

    def __init__(self, name: str, uri: str, on_event: Callable[[GuestEvent], None],
                 on_connect: Callable[[str, bool], None], retry_s: float = 1.0):
        self.name = name
        self.uri = uri
        self.on_event = on_event
        self.on_connect = on_connect
        self.retry_s = retry_s
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lifecycle-{name}", daemon=True)

    def start(self) -> None:
        start_event_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._closed.set()

    def _callback(self, _conn: libvirt.virConnect, dom: libvirt.virDomain, event: int, detail: int,
                  _opaque: object) -> None:
        # Runs on the event loop thread: translate and hand over, nothing slow.
        at = time.time()
        if event == libvirt.VIR_DOMAIN_EVENT_STOPPED and detail in _STOP_CAUSES:
            self.on_event(GuestEvent(self.name, dom.name(), "stopped", _STOP_CAUSES[detail], at))
        elif event == libvirt.VIR_DOMAIN_EVENT_SUSPENDED and detail in _PAUSE_CAUSES:
            self.on_event(GuestEvent(self.name, dom.name(), "paused", _PAUSE_CAUSES[detail], at))
        elif event == libvirt.VIR_DOMAIN_EVENT_CRASHED:
            self.on_event(GuestEvent(self.name, dom.name(), "stopped", "the guest crashed", at))

    def _run(self) -> None:
        reconnect = False
        while not self._stop.is_set():
            try:
                conn = libvirt.open(self.uri)
            except libvirt.libvirtError:
                self._stop.wait(self.retry_s)
                continue
            self._closed.clear()
            # Not every driver has these (test:/// has neither); the isAlive() poll below covers it.
            with contextlib.suppress(libvirt.libvirtError):
                conn.registerCloseCallback(lambda _c, _r, _o: self._closed.set(), None)
            with contextlib.suppress(libvirt.libvirtError):
                conn.setKeepAlive(2, 3)
            try:
                callback_id = conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                                          self._callback, None)
            except libvirt.libvirtError:
                with contextlib.suppress(libvirt.libvirtError):
                    conn.close()
                self._stop.wait(self.retry_s)
                continue
            self.connected.set()
            self.on_connect(self.name, reconnect)
            while not self._closed.wait(0.5):
                try:
                    if conn.isAlive() != 1:
                        break
                except libvirt.libvirtError:
                    break
            self.connected.clear()
            with contextlib.suppress(libvirt.libvirtError):
                conn.domainEventDeregisterAny(callback_id)
            with contextlib.suppress(libvirt.libvirtError):
                conn.unregisterCloseCallback()
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()
            reconnect = True
