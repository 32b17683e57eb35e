"""Host CPU/NUMA topology, parsed from libvirt host capabilities XML.

The planner needs three facts per host CPU: which NUMA node it belongs to, which socket, and
which hyperthread siblings share its physical core. libvirt reports all three in
``<host><topology><cells>`` of ``virConnect.getCapabilities()``; this module turns that into
small frozen dataclasses so a plan can be computed (and tested) without a libvirt connection.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, replace

from pgcarve.errors import ConfigError

# Units libvirt may use in <memory unit=...> / <pages unit=...> (virScaleInteger), in bytes.
_UNITS: dict[str, int] = {
    "b": 1,
    "bytes": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_MIB = 1024**2
_HUGEPAGE_2M_BYTES = 2 * _MIB


@dataclass(frozen=True)
class HostCpu:
    """One online logical host CPU (a hardware thread)."""

    id: int
    socket: int
    core: int  # libvirt core_id: unique within a socket's die only, not host-wide
    node: int
    siblings: tuple[int, ...]  # all threads of this CPU's physical core, itself included, sorted


@dataclass(frozen=True)
class NumaNode:
    """One NUMA cell: its memory, its online CPUs and its configured 2 MiB hugepages."""

    id: int
    memory_mib: int
    cpus: tuple[int, ...]
    hugepages_2m: int  # count of 2 MiB pages configured on this node


@dataclass(frozen=True)
class HostTopology:
    """The CPU and memory layout of one host."""

    cpus: tuple[HostCpu, ...]
    nodes: tuple[NumaNode, ...]
    sockets: int
    cores_per_socket: int
    threads_per_core: int

    @property
    def memory_mib(self) -> int:
        """Total memory over all NUMA nodes (0 when the host reports no per-node memory)."""
        return sum(node.memory_mib for node in self.nodes)

    @property
    def cpu_count(self) -> int:
        """Number of online logical CPUs."""
        return len(self.cpus)

    def physical_cores(self) -> list[tuple[int, ...]]:
        """Return each physical core as its sorted thread ids.

        Ordered by (node, socket, core, lowest thread id) so callers that walk the list get the
        same order on every run. Every online CPU appears in exactly one group.
        """
        by_id = {cpu.id: cpu for cpu in self.cpus}
        seen: set[int] = set()
        groups: list[tuple[tuple[int, int, int, int], tuple[int, ...]]] = []
        for cpu in sorted(self.cpus, key=lambda c: c.id):
            if cpu.id in seen:
                continue
            # Only claim siblings not already grouped, so inconsistent sibling lists still
            # yield a partition instead of a CPU appearing in two cores.
            group = tuple(sorted({cpu.id, *(s for s in cpu.siblings if s in by_id and s not in seen)}))
            seen.update(group)
            groups.append(((cpu.node, cpu.socket, cpu.core, group[0]), group))
        groups.sort(key=lambda item: item[0])
        return [group for _, group in groups]


def parse_cpuset(text: str) -> tuple[int, ...]:
    """Parse a libvirt/Linux cpuset string ("0-3,8,^2") into sorted CPU ids."""
    include: set[int] = set()
    exclude: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        target = include
        if part.startswith("^"):
            target, part = exclude, part[1:]
        try:
            if "-" in part:
                lo_text, hi_text = part.split("-", 1)
                lo, hi = int(lo_text), int(hi_text)
                if lo < 0 or hi < lo:
                    raise ValueError(part)
                target.update(range(lo, hi + 1))
            else:
                value = int(part)
                if value < 0:
                    raise ValueError(part)
                target.add(value)
        except ValueError:
            raise ConfigError(f"invalid CPU list {text!r}: bad element {raw.strip()!r}") from None
    return tuple(sorted(include - exclude))


def format_cpuset(cpus: Iterable[int]) -> str:
    """Format CPU ids as a compact libvirt cpuset string, e.g. (0, 1, 2, 32) -> "0-2,32"."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def _int_attr(elem: ET.Element, name: str, where: str) -> int:
    value = elem.get(name)
    if value is None:
        raise ConfigError(f"host capabilities: {where} has no {name!r} attribute")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"host capabilities: {where} has non-integer {name}={value!r}") from None


def _bytes(elem: ET.Element, where: str) -> int:
    text = (elem.text or "").strip()
    unit = (elem.get("unit") or "KiB").lower()
    if unit not in _UNITS:
        raise ConfigError(f"host capabilities: {where} has unknown unit {elem.get('unit')!r}")
    try:
        return int(text) * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"host capabilities: {where} has non-integer value {text!r}") from None


def _page_size_bytes(elem: ET.Element, where: str) -> int:
    unit = (elem.get("unit") or "KiB").lower()
    if unit not in _UNITS:
        raise ConfigError(f"host capabilities: {where} has unknown unit {elem.get('unit')!r}")
    return _int_attr(elem, "size", where) * _UNITS[unit]


def _page_count(elem: ET.Element, where: str) -> int:
    # <pages> text is a page count, not a size; the unit attribute applies to size= only.
    text = (elem.text or "0").strip() or "0"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"host capabilities: {where} has non-integer count {text!r}") from None


def _parse_cells(cells: ET.Element) -> tuple[list[HostCpu], list[NumaNode], dict[int, set[tuple[int, int]]]]:
    cpus: list[HostCpu] = []
    nodes: list[NumaNode] = []
    # socket -> {(die, core)}: core_id repeats across dies, so count cores per (die, core).
    socket_cores: dict[int, set[tuple[int, int]]] = {}
    seen_ids: set[int] = set()
    for cell in cells.findall("cell"):
        node_id = _int_attr(cell, "id", "<cell>")
        where = f"<cell id='{node_id}'>"
        mem = cell.find("memory")
        memory_mib = _bytes(mem, f"{where} <memory>") // _MIB if mem is not None else 0
        hugepages = 0
        for pages in cell.findall("pages"):
            if _page_size_bytes(pages, f"{where} <pages>") == _HUGEPAGE_2M_BYTES:
                hugepages = _page_count(pages, f"{where} <pages>")
        node_cpus: list[int] = []
        for cpu in cell.findall("cpus/cpu"):
            cpu_id = _int_attr(cpu, "id", f"{where} <cpu>")
            # Offline CPUs are listed with only an id; they cannot be pinned to, so skip them.
            if cpu.get("socket_id") is None or cpu.get("core_id") is None:
                continue
            if cpu_id in seen_ids:
                raise ConfigError(f"host capabilities: CPU {cpu_id} listed in more than one cell")
            seen_ids.add(cpu_id)
            cpu_where = f"{where} <cpu id='{cpu_id}'>"
            socket = _int_attr(cpu, "socket_id", cpu_where)
            core = _int_attr(cpu, "core_id", cpu_where)
            die = int(cpu.get("die_id", "0"))
            siblings_text = cpu.get("siblings")
            siblings = parse_cpuset(siblings_text) if siblings_text else (cpu_id,)
            if cpu_id not in siblings:
                siblings = tuple(sorted((*siblings, cpu_id)))
            cpus.append(HostCpu(id=cpu_id, socket=socket, core=core, node=node_id, siblings=siblings))
            socket_cores.setdefault(socket, set()).add((die, core))
            node_cpus.append(cpu_id)
        nodes.append(
            NumaNode(id=node_id, memory_mib=memory_mib, cpus=tuple(sorted(node_cpus)), hugepages_2m=hugepages)
        )
    return cpus, nodes, socket_cores


def _synthesize(cpu_topology: ET.Element) -> tuple[list[HostCpu], list[NumaNode], int, int, int]:
    """Build one node from <host><cpu><topology> when the driver reports no <cells>.

    Without per-CPU data the numbering is assumed to be Linux's usual x86 enumeration: all first
    threads of every core, then all second threads (siblings i and i + total cores).
    """
    where = "<host><cpu><topology>"
    sockets = _int_attr(cpu_topology, "sockets", where)
    dies = int(cpu_topology.get("dies", "1"))
    cores = _int_attr(cpu_topology, "cores", where)
    threads = _int_attr(cpu_topology, "threads", where)
    if min(sockets, dies, cores, threads) < 1:
        raise ConfigError(f"host capabilities: {where} has a zero or negative count")
    cores_per_socket = dies * cores
    total_cores = sockets * cores_per_socket
    cpus: list[HostCpu] = []
    for t in range(threads):
        for core_index in range(total_cores):
            siblings = tuple(core_index + k * total_cores for k in range(threads))
            cpus.append(
                HostCpu(
                    id=core_index + t * total_cores,
                    socket=core_index // cores_per_socket,
                    core=core_index % cores_per_socket,
                    node=0,
                    siblings=siblings,
                )
            )
    cpus.sort(key=lambda c: c.id)
    node = NumaNode(id=0, memory_mib=0, cpus=tuple(c.id for c in cpus), hugepages_2m=0)
    return cpus, [node], sockets, cores_per_socket, threads


def with_cores_rotated(topology: HostTopology, offset: int) -> HostTopology:
    """The same host with the cores of each socket renumbered to start `offset` cores further
    along (modulo the socket's cores), so that slots, laid out in core order, begin there. CPU ids,
    siblings and NUMA nodes are unchanged. The sandbox uses it: its hosts are one machine, and
    without it every guest of an instance would share that machine's first core."""
    if offset == 0:
        return topology
    cores_of: dict[tuple[int, int], list[int]] = {}
    for cpu in topology.cpus:
        cores = cores_of.setdefault((cpu.node, cpu.socket), [])
        if cpu.core not in cores:
            cores.append(cpu.core)
    for cores in cores_of.values():
        cores.sort()

    def renumbered(cpu: HostCpu) -> HostCpu:
        cores = cores_of[(cpu.node, cpu.socket)]
        return replace(cpu, core=(cores.index(cpu.core) - offset) % len(cores))

    return replace(topology, cpus=tuple(renumbered(cpu) for cpu in topology.cpus))


def parse_capabilities(xml: str) -> HostTopology:
    """Parse ``virConnect.getCapabilities()`` output into a HostTopology.

    Raises ConfigError naming the problem when the XML is malformed or has no usable topology.
    Offline CPUs are left out. A host without ``<cells>`` becomes one node holding every CPU
    (from ``<host><cpu><topology>``) with 0 MiB memory, as its memory is not reported there.
    """
    try:
        # Capabilities come from the local libvirt daemon we connected to, not from users.
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise ConfigError(f"host capabilities are not valid XML: {exc}") from None
    if root.tag != "capabilities":
        raise ConfigError(f"host capabilities: root element is <{root.tag}>, expected <capabilities>")
    host = root.find("host")
    if host is None:
        raise ConfigError("host capabilities: no <host> element")
    cells = host.find("topology/cells")
    cpu_topology = host.find("cpu/topology")

    if cells is not None and cells.find("cell/cpus/cpu") is not None:
        cpus, nodes, socket_cores = _parse_cells(cells)
        if not cpus:
            raise ConfigError("host capabilities: <topology> lists no online CPUs")
        # <cpu><topology sockets=> is per NUMA node in libvirt, so count sockets from the cells.
        sockets = len(socket_cores)
        cores_per_socket = max(len(cores) for cores in socket_cores.values())
        threads_per_core = max(len(cpu.siblings) for cpu in cpus)
    elif cpu_topology is not None:
        cpus, nodes, sockets, cores_per_socket, threads_per_core = _synthesize(cpu_topology)
    elif host.find("topology") is None:
        raise ConfigError("host capabilities: no <topology> element under <host>")
    else:
        raise ConfigError("host capabilities: <topology> has no CPUs and <cpu><topology> is missing")

    return HostTopology(
        cpus=tuple(sorted(cpus, key=lambda c: c.id)),
        nodes=tuple(sorted(nodes, key=lambda n: n.id)),
        sockets=sockets,
        cores_per_socket=cores_per_socket,
        threads_per_core=threads_per_core,
    )
