"""Read-only facts about a host that `pgcarve doctor` checks: nothing here defines, starts,
builds or uploads anything (LibvirtHost.storage.ensure_pool, by contrast, creates the pool).

Each function returns None for "not there" and raises pgcarve's errors (LibvirtHost.translate)
for anything else.
"""

from __future__ import annotations

import contextlib
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass

import libvirt

from pgcarve.virt.host import LibvirtHost

_MIB = 1024 * 1024
_HUGEPAGE_2M_KIB = 2048


@dataclass(frozen=True)
class NetworkFacts:
    """A libvirt network as its definition and state say."""

    active: bool
    autostart: bool
    forward: str | None  # forward mode: nat, route, open, bridge, ...; None: isolated (no <forward>)


@dataclass(frozen=True)
class PoolFacts:
    """A storage pool as its definition and state say."""

    active: bool
    autostart: bool
    path: str  # its target directory
    free_mib: int | None  # None while it is not active (libvirt reads it from the running pool)


def network_facts(host: LibvirtHost, name: str) -> NetworkFacts | None:
    """The network's state and forward mode; None if it is not defined."""
    with host.translate(f"reading network {name}"):
        try:
            net = host.conn.networkLookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_NETWORK:
                return None
            raise
        forward = ET.fromstring(net.XMLDesc(0)).find("forward")
        # A <forward> without a mode is NAT, libvirt's default.
        mode = None if forward is None else forward.get("mode", "nat")
        return NetworkFacts(active=net.isActive() == 1, autostart=net.autostart() == 1, forward=mode)


def pool_facts(host: LibvirtHost, name: str) -> PoolFacts | None:
    """The pool's state, directory and free space; None if it is not defined."""
    with host.translate(f"reading storage pool {name}"):
        try:
            pool = host.conn.storagePoolLookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_POOL:
                return None
            raise
        active = pool.isActive() == 1
        if active:
            with contextlib.suppress(libvirt.libvirtError):  # a busy pool keeps its last figures
                pool.refresh(0)
        path = ET.fromstring(pool.XMLDesc(0)).findtext("target/path") or ""
        return PoolFacts(active=active, autostart=pool.autostart() == 1, path=path,
                         free_mib=int(pool.info()[3] // _MIB) if active else None)


def kvm_offered(host: LibvirtHost, arch: str = "x86_64") -> bool:
    """Do the host's capabilities offer a kvm domain for `arch` guests? libvirt lists one only
    where QEMU can use /dev/kvm; whether a guest then boots is the probe's question
    (virt/probe.py)."""
    root = ET.fromstring(host.capabilities())
    return any(guest.find(f"arch[@name='{arch}']/domain[@type='kvm']") is not None
               for guest in root.findall("guest"))


def free_hugepages_2m(host: LibvirtHost, nodes: Sequence[int]) -> dict[int, int] | None:
    """Free 2 MiB pages per NUMA node now (virNodeGetFreePages); None where libvirt does not
    report them."""
    if not nodes:
        return None
    first, last = min(nodes), max(nodes)
    with host.translate("reading free hugepages"):
        try:
            found = host.conn.getFreePages([_HUGEPAGE_2M_KIB], first, last - first + 1, 0)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() in (libvirt.VIR_ERR_NO_SUPPORT, libvirt.VIR_ERR_OPERATION_INVALID,
                                        libvirt.VIR_ERR_OPERATION_UNSUPPORTED):
                return None
            raise
    counts = {int(node): int(sizes[_HUGEPAGE_2M_KIB]) for node, sizes in (found or {}).items()
              if _HUGEPAGE_2M_KIB in sizes}
    return counts if set(nodes) <= set(counts) else None
