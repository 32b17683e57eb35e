"""Decide which host CPUs and which NUMA node each instance (guest) gets.

The plan is a pure function of (topology, config): every possible slot is laid out in a fixed
order (nodes in id order, cores in ``HostTopology.physical_cores()`` order) and instance i takes
slot i. Scaling from N to N+1 instances therefore only appends a slot, and every caller (CLI,
API, Terraform) that plans the same host with the same config gets identical pinning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pgcarve.errors import CapacityError, ConfigError
from pgcarve.planning.topology import HostTopology, format_cpuset

# Below this many CPUs a dedicated housekeeping core would cost too large a share of the host.
AUTO_HOUSEKEEPING_MIN_CPUS = 8
HUGEPAGE_MIB = 2


@dataclass(frozen=True)
class PlannerConfig:
    """Per-instance size and host-level reservations used to plan a host."""

    vcpus_per_instance: int = 1
    memory_mib_per_instance: int = 1024
    # None = auto: first core of each socket on hosts with >= 8 CPUs, nothing on smaller hosts.
    # Otherwise a CPU count, rounded up to whole cores.
    housekeeping_cpus: int | None = None
    hugepages: bool = False
    host_memory_reserve_mib: int = 1024  # kept for the host itself

    def __post_init__(self) -> None:
        if self.vcpus_per_instance < 1:
            raise ConfigError(f"vcpus_per_instance must be >= 1, got {self.vcpus_per_instance}")
        if self.memory_mib_per_instance < 1:
            raise ConfigError(f"memory_mib_per_instance must be >= 1, got {self.memory_mib_per_instance}")
        if self.housekeeping_cpus is not None and self.housekeeping_cpus < 0:
            raise ConfigError(f"housekeeping_cpus must be >= 0 or unset, got {self.housekeeping_cpus}")
        if self.host_memory_reserve_mib < 0:
            raise ConfigError(f"host_memory_reserve_mib must be >= 0, got {self.host_memory_reserve_mib}")


@dataclass(frozen=True)
class InstanceSlot:
    """Where one instance runs."""

    index: int  # 1-based instance number
    host_cpus: tuple[int, ...]  # vcpu k is pinned to host_cpus[k]
    numa_node: int
    memory_mib: int


@dataclass(frozen=True)
class HostPlan:
    """Pinning for the requested instances on one host."""

    housekeeping_cpus: tuple[int, ...]  # emulatorpin target; empty on tiny hosts
    emulator_cpus: tuple[int, ...]  # <emulatorpin>: housekeeping CPUs if any, else all host CPUs
    slots: tuple[InstanceSlot, ...]  # the requested instances, index 1..N
    capacity: int  # max instances this host can hold with this config
    notes: tuple[str, ...]  # human explanations


@dataclass(frozen=True)
class _Layout:
    """Every slot the host can hold, plus the numbers needed to explain the limit."""

    housekeeping: tuple[int, ...]
    slots: tuple[InstanceSlot, ...]
    cpu_slots: int  # instances if only CPU counted (still per node)
    memory_slots: int  # instances if only memory counted (still per node)
    free_cores: int
    cores_per_instance: int
    usable_memory_mib: int  # non-hugepage budget summed over nodes with CPUs
    hugepages_free: int  # 2 MiB pages on nodes with CPUs
    pages_per_instance: int
    memory_known: bool
    notes: tuple[str, ...]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _housekeeping(
    topology: HostTopology, config: PlannerConfig, cores: list[tuple[int, ...]], socket_of: dict[int, int]
) -> tuple[tuple[int, ...], str]:
    """Pick housekeeping cores: whole cores, spread one core per socket before a second."""
    by_socket: dict[int, list[tuple[int, ...]]] = {}
    for core in cores:
        by_socket.setdefault(socket_of[core[0]], []).append(core)
    sockets = list(by_socket)  # first-appearance order == node order, matching slot fill order

    chosen: list[tuple[int, ...]] = []
    wanted = config.housekeeping_cpus
    if wanted is None:
        if topology.cpu_count < AUTO_HOUSEKEEPING_MIN_CPUS:
            return (), (
                f"housekeeping: none reserved on a {topology.cpu_count}-CPU host "
                f"(auto reserves only from {AUTO_HOUSEKEEPING_MIN_CPUS} CPUs); emulator threads float "
                "over all host CPUs and can take time from vCPUs"
            )
        chosen = [by_socket[s][0] for s in sockets]
        cpus = tuple(sorted(c for core in chosen for c in core))
        return cpus, (
            f"housekeeping: first core of each socket (CPUs {format_cpuset(cpus)}) reserved for emulator "
            f"threads and the host (auto, host has {topology.cpu_count} CPUs)"
        )

    if wanted > topology.cpu_count:
        raise ConfigError(f"housekeeping_cpus={wanted} exceeds the host's {topology.cpu_count} CPUs")
    if wanted == 0:
        return (), "housekeeping: 0 CPUs requested; emulator threads float over all host CPUs"
    taken = 0
    depth = 0
    # Round-robin over sockets so every socket's memory controller has a local host core.
    while taken < wanted:
        for s in sockets:
            if depth < len(by_socket[s]) and taken < wanted:
                chosen.append(by_socket[s][depth])
                taken += len(by_socket[s][depth])
        depth += 1
    cpus = tuple(sorted(c for core in chosen for c in core))
    rounded = f", rounded up to {_plural(len(chosen), 'whole core')}" if taken != wanted else ""
    return cpus, (
        f"housekeeping: {_plural(wanted, 'CPU')} requested{rounded} (CPUs {format_cpuset(cpus)}), "
        "spread one core per socket first; emulator threads pinned there"
    )


def _reserve_shares(topology: HostTopology, reserve_mib: int) -> dict[int, int]:
    """Split the host reserve over nodes in proportion to their memory (rounded up, to be safe)."""
    total = topology.memory_mib
    if total <= 0:
        return {node.id: 0 for node in topology.nodes}
    return {node.id: -(-reserve_mib * node.memory_mib // total) for node in topology.nodes}


def _layout(topology: HostTopology, config: PlannerConfig) -> _Layout:
    """Lay out every slot the host can hold, in deterministic order. O(number of CPUs)."""
    vcpus = config.vcpus_per_instance
    mem = config.memory_mib_per_instance
    socket_of = {cpu.id: cpu.socket for cpu in topology.cpus}
    node_of = {cpu.id: cpu.node for cpu in topology.cpus}
    cores = topology.physical_cores()
    housekeeping, hk_note = _housekeeping(topology, config, cores, socket_of)
    reserved = set(housekeeping)
    notes = [hk_note]

    free_by_node: dict[int, list[tuple[int, ...]]] = {node.id: [] for node in topology.nodes}
    for core in cores:
        if core[0] not in reserved:
            free_by_node.setdefault(node_of[core[0]], []).append(core)

    memory_known = topology.memory_mib > 0
    shares = _reserve_shares(topology, config.host_memory_reserve_mib)
    pages_per_instance = -(-mem // HUGEPAGE_MIB)

    slots: list[InstanceSlot] = []
    cpu_slots = memory_slots = free_cores = usable_memory = hugepages_free = 0
    idle_threads = 0
    for node in topology.nodes:
        if not node.cpus:
            if node.memory_mib:
                notes.append(f"node {node.id} has no online CPUs; its memory is not used for instances")
            continue
        # Greedy whole-core chunks: ceil(vcpus / threads) cores each on a uniform host.
        chunks: list[list[tuple[int, ...]]] = []
        chunk: list[tuple[int, ...]] = []
        threads = 0
        for core in free_by_node.get(node.id, []):
            chunk.append(core)
            threads += len(core)
            if threads >= vcpus:
                chunks.append(chunk)
                chunk, threads = [], 0
        free_cores += len(free_by_node.get(node.id, []))

        if config.hugepages:
            hugepages_free += node.hugepages_2m
            node_mem_slots = node.hugepages_2m // pages_per_instance
        elif memory_known:
            budget = max(0, node.memory_mib - shares[node.id])
            usable_memory += budget
            node_mem_slots = budget // mem
            if node.memory_mib == 0:
                notes.append(
                    f"node {node.id} has CPUs but no memory; skipped (strict binding needs local memory)"
                )
        else:
            node_mem_slots = 0
        cpu_slots += len(chunks)
        memory_slots += node_mem_slots
        for chunk in chunks[: min(len(chunks), node_mem_slots)]:
            threads_of_chunk = tuple(t for core in chunk for t in core)
            idle_threads = max(idle_threads, len(threads_of_chunk) - vcpus)
            slots.append(
                InstanceSlot(
                    index=len(slots) + 1,
                    host_cpus=threads_of_chunk[:vcpus],
                    numa_node=node.id,
                    memory_mib=mem,
                )
            )

    tpc = topology.threads_per_core
    cores_per_instance = -(-vcpus // tpc)
    cores_text = (
        f"each instance gets {_plural(cores_per_instance, 'whole physical core')} "
        f"({_plural(tpc, 'thread')} per core) for {_plural(vcpus, 'vCPU')}"
    )
    if idle_threads:
        cores_text += (
            f"; leftover sibling threads (up to {idle_threads} per instance) stay idle so no two "
            "instances share a core"
        )
    notes.append(cores_text)

    if config.hugepages:
        rounded = f" (memory rounded up to {pages_per_instance * HUGEPAGE_MIB} MiB)" if mem % 2 else ""
        per_node = ", ".join(f"{n.id}:{n.hugepages_2m}" for n in topology.nodes if n.cpus)
        notes.append(
            f"memory: backed by 2 MiB hugepages on the instance's node, {pages_per_instance} pages each"
            f"{rounded}; configured pages per node {per_node}; assumed free for pgcarve, so the host "
            "reserve is not taken from them"
        )
    elif memory_known:
        notes.append(
            "memory: bound strictly to the instance's NUMA node; the "
            f"{config.host_memory_reserve_mib} MiB host reserve is split across nodes by size"
        )
    else:
        notes.append(
            "memory: the host capabilities report no NUMA memory (0 MiB), so no instance fits; "
            "supply node memory to plan this host"
        )

    layout = _Layout(
        housekeeping=housekeeping,
        slots=tuple(slots),
        cpu_slots=cpu_slots,
        memory_slots=memory_slots,
        free_cores=free_cores,
        cores_per_instance=cores_per_instance,
        usable_memory_mib=usable_memory,
        hugepages_free=hugepages_free,
        pages_per_instance=pages_per_instance,
        memory_known=memory_known,
        notes=(),
    )
    notes.append(f"capacity: {_plural(len(slots), 'instance')}, {_limit_text(layout, topology, config)}")
    return replace(layout, notes=tuple(notes))


def _limit_text(layout: _Layout, topology: HostTopology, config: PlannerConfig) -> str:
    """Name the resource that caps the instance count."""
    cap = len(layout.slots)
    cpu_text = (
        f"{_plural(layout.free_cores, 'free physical core')}, {layout.cores_per_instance} per instance, "
        f"an instance stays within one of {_plural(sum(1 for n in topology.nodes if n.cpus), 'NUMA node')}"
    )
    if config.hugepages:
        mem_text = (
            f"{layout.hugepages_free} configured 2 MiB hugepages, {layout.pages_per_instance} per instance"
        )
    elif layout.memory_known:
        mem_text = (
            f"{layout.usable_memory_mib} MiB usable after the {config.host_memory_reserve_mib} MiB host "
            f"reserve, {config.memory_mib_per_instance} MiB per instance, per NUMA node"
        )
    else:
        mem_text = "the host reports 0 MiB of memory"
    cpu_limits = cap == layout.cpu_slots
    mem_limits = cap == layout.memory_slots
    if cpu_limits and mem_limits:
        return f"limited by CPU ({cpu_text}) and memory ({mem_text})"
    if cpu_limits:
        return f"limited by CPU: {cpu_text}"
    if mem_limits:
        return f"limited by memory: {mem_text}"
    return f"limited by CPU on some NUMA nodes and memory on others: {cpu_text}; {mem_text}"


def capacity(topology: HostTopology, config: PlannerConfig) -> int:
    """Return how many instances of this config the host can hold."""
    return len(_layout(topology, config).slots)


def plan_host(topology: HostTopology, config: PlannerConfig, instances: int) -> HostPlan:
    """Plan instances 1..``instances`` on a host.

    Raises ConfigError for a negative count and CapacityError, naming the capacity and the
    limiting resource, when the host cannot hold that many.
    """
    if instances < 0:
        raise ConfigError(f"instance count must be >= 0, got {instances}")
    layout = _layout(topology, config)
    cap = len(layout.slots)
    if instances > cap:
        raise CapacityError(
            f"host has room for {_plural(cap, 'instance')} of {config.vcpus_per_instance} vCPU / "
            f"{config.memory_mib_per_instance} MiB ({topology.cpu_count} CPUs, "
            f"{len(layout.housekeeping)} reserved for housekeeping); "
            f"{_limit_text(layout, topology, config)}; {instances} requested"
        )
    all_cpus = tuple(sorted(cpu.id for cpu in topology.cpus))
    return HostPlan(
        housekeeping_cpus=layout.housekeeping,
        emulator_cpus=layout.housekeeping or all_cpus,
        slots=layout.slots[:instances],
        capacity=cap,
        notes=layout.notes,
    )


def explain(plan: HostPlan, topology: HostTopology, config: PlannerConfig) -> str:
    """Render a plan as multi-line text for operators."""
    lines = [
        f"host: {topology.cpu_count} CPUs ({_plural(topology.sockets, 'socket')} x "
        f"{_plural(topology.cores_per_socket, 'core')} x {_plural(topology.threads_per_core, 'thread')}), "
        f"{_plural(len(topology.nodes), 'NUMA node')}, {topology.memory_mib} MiB memory",
        f"config: {config.vcpus_per_instance} vCPU / {config.memory_mib_per_instance} MiB per instance, "
        f"hugepages {'on' if config.hugepages else 'off'}, host reserve {config.host_memory_reserve_mib} MiB",
        f"capacity: {_plural(plan.capacity, 'instance')}; planned: {len(plan.slots)}",
    ]
    if plan.housekeeping_cpus:
        lines.append(
            f"housekeeping CPUs: {format_cpuset(plan.housekeeping_cpus)} (emulator threads pinned here)"
        )
    else:
        lines.append(
            f"housekeeping CPUs: none (emulator threads float over {format_cpuset(plan.emulator_cpus)})"
        )
    for slot in plan.slots:
        cpus = ",".join(str(c) for c in slot.host_cpus)  # keep order: vCPU k -> k-th CPU
        lines.append(f"instance {slot.index}: CPUs {cpus} on node {slot.numa_node}, {slot.memory_mib} MiB")
    if plan.notes:
        lines.append("notes:")
        lines.extend(f"  - {note}" for note in plan.notes)
    return "\n".join(lines)


def plan_to_dict(plan: HostPlan) -> dict[str, Any]:
    """Return the plan as plain JSON-serialisable data."""
    return {
        "capacity": plan.capacity,
        "housekeeping_cpus": list(plan.housekeeping_cpus),
        "emulator_cpus": list(plan.emulator_cpus),
        "slots": [
            {
                "index": slot.index,
                "host_cpus": list(slot.host_cpus),
                "numa_node": slot.numa_node,
                "memory_mib": slot.memory_mib,
            }
            for slot in plan.slots
        ],
        "notes": list(plan.notes),
    }

