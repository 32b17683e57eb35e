"""Planner invariants: whole cores, one NUMA node per instance, stable slots, clear capacity errors."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pgcarve.errors import CapacityError, ConfigError
from pgcarve.planning.planner import (
    HostPlan,
    PlannerConfig,
    capacity,
    explain,
    plan_host,
    plan_to_dict,
)
from pgcarve.planning.topology import HostTopology, parse_capabilities, with_cores_rotated

CAPS_DIR = Path(__file__).resolve().parent.parent / "data" / "capabilities"
FIXTURES = ["local-2cpu", "single-node-64t", "two-socket-128t", "eight-node-512t", "test-driver"]


@cache
def load(name: str) -> HostTopology:
    if name == "test-driver":
        libvirt = pytest.importorskip("libvirt")
        conn = libvirt.open("test:///default")
        try:
            return parse_capabilities(conn.getCapabilities())
        finally:
            conn.close()
    return parse_capabilities((CAPS_DIR / f"{name}.xml").read_text())


CONFIGS = [
    PlannerConfig(vcpus_per_instance=v, memory_mib_per_instance=m, hugepages=hp, housekeeping_cpus=hk)
    for v, m in [(1, 1024), (2, 4096), (3, 3001), (4, 16384), (8, 65536)]
    for hp in (False, True)
    for hk in (None, 0, 3)
]


def config_id(c: PlannerConfig) -> str:
    return (
        f"v{c.vcpus_per_instance}-m{c.memory_mib_per_instance}-hp{int(c.hugepages)}-hk{c.housekeeping_cpus}"
    )


def check_invariants(topo: HostTopology, config: PlannerConfig, plan: HostPlan) -> None:
    """Every property a plan must have, checked against the topology independently of the planner."""
    by_id = {cpu.id: cpu for cpu in topo.cpus}
    nodes = {n.id: n for n in topo.nodes}
    housekeeping = set(plan.housekeeping_cpus)
    used_cpus: set[int] = set()
    used_cores: set[tuple[int, ...]] = set()
    hk_cores = {by_id[c].siblings for c in housekeeping}
    # Housekeeping is whole cores.
    assert {c for core in hk_cores for c in core} == housekeeping
    assert plan.emulator_cpus == (plan.housekeeping_cpus or tuple(sorted(by_id)))
    memory_by_node: dict[int, int] = {}
    for i, slot in enumerate(plan.slots, start=1):
        assert slot.index == i
        assert len(slot.host_cpus) == config.vcpus_per_instance
        assert len(set(slot.host_cpus)) == len(slot.host_cpus)
        cpus = set(slot.host_cpus)
        assert not cpus & used_cpus, "CPU sets must be pairwise disjoint"
        assert not cpus & housekeeping
        cores = {by_id[c].siblings for c in cpus}
        assert not cores & used_cores, "instances must not share a physical core"
        assert not cores & hk_cores
        assert cpus <= set(nodes[slot.numa_node].cpus)
        # No more cores than needed: ceil(vcpus / threads per core) on these uniform hosts.
        assert len(cores) == -(-config.vcpus_per_instance // topo.threads_per_core)
        used_cpus |= cpus
        used_cores |= cores
        assert slot.memory_mib == config.memory_mib_per_instance
        memory_by_node[slot.numa_node] = memory_by_node.get(slot.numa_node, 0) + slot.memory_mib
    for node_id, used in memory_by_node.items():
        node = nodes[node_id]
        if config.hugepages:
            pages = -(-config.memory_mib_per_instance // 2)
            assert pages * (used // config.memory_mib_per_instance) <= node.hugepages_2m
        else:
            assert used <= node.memory_mib
    if not config.hugepages:
        assert (
            sum(memory_by_node.values()) <= topo.memory_mib - config.host_memory_reserve_mib or not plan.slots
        )


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("name", FIXTURES)
def test_plan_at_capacity(name: str, config: PlannerConfig) -> None:
    topo = load(name)
    if (config.housekeeping_cpus or 0) > topo.cpu_count:
        with pytest.raises(ConfigError, match="exceeds"):
            plan_host(topo, config, 0)
        return
    cap = capacity(topo, config)
    full = plan_host(topo, config, cap)
    assert full.capacity == cap
    assert len(full.slots) == cap
    check_invariants(topo, config, full)

    # Stability: the plan for N is a prefix of the plan for any larger count.
    for n in {0, 1, cap // 2, cap - 1} - {-1}:
        if n <= cap:
            smaller = plan_host(topo, config, n)
            assert smaller.slots == full.slots[:n]
            assert smaller.housekeeping_cpus == full.housekeeping_cpus

    with pytest.raises(CapacityError) as info:
        plan_host(topo, config, cap + 1)
    message = str(info.value)
    assert f"room for {cap} instance" in message
    assert f"{cap + 1} requested" in message
    assert "limited by" in message

    with pytest.raises(ConfigError):
        plan_host(topo, config, -1)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(FIXTURES[:4]),
    vcpus=st.integers(min_value=1, max_value=12),
    memory=st.integers(min_value=1, max_value=70000),
    housekeeping=st.one_of(st.none(), st.integers(min_value=0, max_value=9)),
    hugepages=st.booleans(),
    reserve=st.integers(min_value=0, max_value=8192),
)
def test_random_configs(
    name: str, vcpus: int, memory: int, housekeeping: int | None, hugepages: bool, reserve: int
) -> None:
    topo = load(name)
    if housekeeping is not None and housekeeping > topo.cpu_count:
        with pytest.raises(ConfigError):
            capacity(topo, PlannerConfig(housekeeping_cpus=housekeeping))
        return
    config = PlannerConfig(
        vcpus_per_instance=vcpus,
        memory_mib_per_instance=memory,
        housekeeping_cpus=housekeeping,
        hugepages=hugepages,
        host_memory_reserve_mib=reserve,
    )
    plan = plan_host(topo, config, capacity(topo, config))
    check_invariants(topo, config, plan)
    if housekeeping:
        assert len(plan.housekeeping_cpus) >= housekeeping


def test_tiny_host_floats_emulator_and_uses_both_cpus() -> None:
    topo = load("local-2cpu")
    plan = plan_host(topo, PlannerConfig(), 2)
    assert plan.housekeeping_cpus == ()
    assert plan.emulator_cpus == (0, 1)
    assert [s.host_cpus for s in plan.slots] == [(0,), (1,)]
    assert plan.capacity == 2
    with pytest.raises(CapacityError) as info:
        plan_host(topo, PlannerConfig(), 3)
    assert str(info.value).startswith(
        "host has room for 2 instances of 1 vCPU / 1024 MiB (2 CPUs, 0 reserved for housekeeping); "
        "limited by CPU"
    )


def test_rotated_cores_start_the_slots_further_along() -> None:
    """The sandbox's standby hosts (the same machine as its primary host) start half-way along:
    an instance's standbys then run on another core than its primary."""
    topo = load("local-2cpu")
    assert with_cores_rotated(topo, 0) is topo
    assert [s.host_cpus for s in plan_host(with_cores_rotated(topo, 1), PlannerConfig(), 2).slots] == [(1,), (0,)]
    assert [s.host_cpus for s in plan_host(with_cores_rotated(topo, 3), PlannerConfig(), 2).slots] == [(1,), (0,)]


@pytest.mark.parametrize("name", ["single-node-64t", "two-socket-128t"])
@pytest.mark.parametrize("offset", [1, 16, 31])
def test_rotation_keeps_cores_whole_and_nodes_in_order(name: str, offset: int) -> None:
    topo = load(name)
    config = PlannerConfig(vcpus_per_instance=2, memory_mib_per_instance=1024, housekeeping_cpus=0)
    rotated = with_cores_rotated(topo, offset)
    plan = plan_host(rotated, config, capacity(topo, config))
    check_invariants(rotated, config, plan)
    assert capacity(rotated, config) == capacity(topo, config)
    straight = plan_host(topo, config, capacity(topo, config))
    assert sorted(s.host_cpus for s in plan.slots) == sorted(s.host_cpus for s in straight.slots)
    assert plan.slots[0].host_cpus != straight.slots[0].host_cpus
    assert [s.numa_node for s in plan.slots] == [s.numa_node for s in straight.slots]


def test_auto_housekeeping_reserves_first_core_per_socket() -> None:
    single = plan_host(load("single-node-64t"), PlannerConfig(), 1)
    assert single.housekeeping_cpus == (0, 32)
    assert single.capacity == 31
    assert single.slots[0].host_cpus == (1,)
    two = plan_host(load("two-socket-128t"), PlannerConfig(), 0)
    assert two.housekeeping_cpus == (0, 32, 64, 96)
    assert two.capacity == 62
    eight = plan_host(load("eight-node-512t"), PlannerConfig(), 0)
    assert eight.housekeeping_cpus == tuple(sorted(32 * s + k for s in range(8) for k in (0, 256)))


def test_auto_housekeeping_threshold_is_eight_cpus() -> None:
    for cores, reserved in [(7, ()), (8, (0,))]:
        cpu = f"<cpu><topology sockets='1' cores='{cores}' threads='1'/></cpu>"
        topo = parse_capabilities(f"<capabilities><host>{cpu}</host></capabilities>")
        # No <cells> means no memory is reported; supply it as a caller with virNodeGetInfo would.
        topo = dataclasses.replace(topo, nodes=(dataclasses.replace(topo.nodes[0], memory_mib=65536),))
        plan = plan_host(topo, PlannerConfig(), 0)
        assert plan.housekeeping_cpus == reserved
        assert plan.capacity == cores - len(reserved)


def test_explicit_housekeeping_rounds_to_cores_and_spreads_over_sockets() -> None:
    single = load("single-node-64t")
    assert plan_host(single, PlannerConfig(housekeeping_cpus=1), 0).housekeeping_cpus == (0, 32)
    assert plan_host(single, PlannerConfig(housekeeping_cpus=3), 0).housekeeping_cpus == (0, 1, 32, 33)
    two = load("two-socket-128t")
    # 3 CPUs -> 2 whole cores, one on each socket before a second on socket 0.
    assert plan_host(two, PlannerConfig(housekeeping_cpus=3), 0).housekeeping_cpus == (0, 32, 64, 96)
    assert plan_host(two, PlannerConfig(housekeeping_cpus=5), 0).housekeeping_cpus == (0, 1, 32, 64, 65, 96)
    none = plan_host(two, PlannerConfig(housekeeping_cpus=0), 0)
    assert none.housekeeping_cpus == ()
    assert none.emulator_cpus == tuple(range(128))
    assert none.capacity == 64
    with pytest.raises(ConfigError, match="exceeds"):
        capacity(two, PlannerConfig(housekeeping_cpus=129))
    assert capacity(two, PlannerConfig(housekeeping_cpus=128)) == 0


def test_vcpus_fill_sibling_threads_in_order() -> None:
    topo = load("single-node-64t")
    two = plan_host(topo, PlannerConfig(vcpus_per_instance=2), 2)
    assert [s.host_cpus for s in two.slots] == [(1, 33), (2, 34)]
    three = plan_host(topo, PlannerConfig(vcpus_per_instance=3), 2)
    assert [s.host_cpus for s in three.slots] == [(1, 33, 2), (3, 35, 4)]
    assert any("idle" in note for note in three.notes)
    assert capacity(topo, PlannerConfig(vcpus_per_instance=3)) == 15


def test_nodes_fill_in_order() -> None:
    topo = load("two-socket-128t")
    plan = plan_host(topo, PlannerConfig(vcpus_per_instance=8), 8)
    assert [s.numa_node for s in plan.slots] == [0, 0, 0, 0, 0, 0, 0, 1]
    assert plan.slots[7].host_cpus[:2] == (33, 97)


def test_memory_limits_capacity() -> None:
    topo = load("single-node-64t")
    config = PlannerConfig(memory_mib_per_instance=65536)
    # (262144 - 1024 reserve) // 65536 = 3
    assert capacity(topo, config) == 3
    with pytest.raises(CapacityError, match="limited by memory") as info:
        plan_host(topo, config, 4)
    assert "room for 3 instances" in str(info.value)


def test_test_driver_memory_is_per_node() -> None:
    topo = load("test-driver")
    # node 0: 2048 MiB minus its share of the reserve -> one 1 GiB guest; node 1: 4096 -> three.
    plan = plan_host(topo, PlannerConfig(), 4)
    assert [s.numa_node for s in plan.slots] == [0, 1, 1, 1]
    assert plan.housekeeping_cpus == (0, 8)
    with pytest.raises(CapacityError, match="limited by memory"):
        plan_host(topo, PlannerConfig(), 5)


def test_hugepages_limit_capacity() -> None:
    topo = load("eight-node-512t")
    config = PlannerConfig(vcpus_per_instance=2, memory_mib_per_instance=16384, hugepages=True)
    # 8192 pages per instance: 8 each on nodes 0-3, 4 on nodes 4-5, none on 6-7.
    plan = plan_host(topo, config, capacity(topo, config))
    assert plan.capacity == 40
    assert {s.numa_node for s in plan.slots} == {0, 1, 2, 3, 4, 5}
    assert any("hugepages" in note for note in plan.notes)
    assert capacity(load("single-node-64t"), dataclasses.replace(config)) == 0


def test_no_memory_reported_means_no_capacity() -> None:
    topo = parse_capabilities(
        "<capabilities><host><cpu><topology sockets='1' cores='4' threads='1'/></cpu></host></capabilities>"
    )
    with pytest.raises(CapacityError, match="0 MiB") as info:
        plan_host(topo, PlannerConfig(), 1)
    assert "room for 0 instances" in str(info.value)


def test_memoryless_and_cpuless_nodes_are_skipped() -> None:
    base = load("two-socket-128t")
    node0, node1 = base.nodes
    # node 0 keeps its CPUs but loses its memory; an extra memory-only node 2 is added.
    extra = dataclasses.replace(node1, id=2, cpus=())
    topo = dataclasses.replace(base, nodes=(dataclasses.replace(node0, memory_mib=0), node1, extra))
    plan = plan_host(topo, PlannerConfig(), capacity(topo, PlannerConfig()))
    assert {s.numa_node for s in plan.slots} == {1}
    assert plan.capacity == 31
    assert any("node 0 has CPUs but no memory" in n for n in plan.notes)
    assert any("node 2 has no online CPUs" in n for n in plan.notes)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vcpus_per_instance": 0},
        {"memory_mib_per_instance": 0},
        {"housekeeping_cpus": -1},
        {"host_memory_reserve_mib": -1},
    ],
)
def test_invalid_config(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        PlannerConfig(**kwargs)  # type: ignore[arg-type]


def test_deterministic_across_parses() -> None:
    xml = (CAPS_DIR / "eight-node-512t.xml").read_text()
    config = PlannerConfig(vcpus_per_instance=4)
    a = plan_host(parse_capabilities(xml), config, 50)
    b = plan_host(parse_capabilities(xml), config, 50)
    assert a == b
    assert plan_to_dict(a) == plan_to_dict(b)


def test_plan_to_dict_and_explain() -> None:
    topo = load("two-socket-128t")
    config = PlannerConfig(vcpus_per_instance=2, memory_mib_per_instance=2048)
    plan = plan_host(topo, config, 3)
    data = json.loads(json.dumps(plan_to_dict(plan)))
    assert data["capacity"] == plan.capacity
    assert data["housekeeping_cpus"] == [0, 32, 64, 96]
    assert data["slots"][0] == {"index": 1, "host_cpus": [1, 65], "numa_node": 0, "memory_mib": 2048}
    assert len(data["notes"]) == len(plan.notes)
    text = explain(plan, topo, config)
    assert "128 CPUs (2 sockets x 32 cores x 2 threads)" in text
    assert "housekeeping CPUs: 0,32,64,96" in text
    assert "instance 1: CPUs 1,65 on node 0, 2048 MiB" in text
    assert "instance 3: CPUs 3,67 on node 0, 2048 MiB" in text
    assert f"capacity: {plan.capacity} instances; planned: 3" in text
    tiny = load("local-2cpu")
    assert "none (emulator threads float over 0-1)" in explain(
        plan_host(tiny, PlannerConfig(), 1), tiny, PlannerConfig()
    )


