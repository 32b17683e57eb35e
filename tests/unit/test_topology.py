"""Parsing libvirt host capabilities into HostTopology."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pgcarve.errors import ConfigError
from pgcarve.planning.topology import HostTopology, format_cpuset, parse_capabilities, parse_cpuset

CAPS_DIR = Path(__file__).resolve().parent.parent / "data" / "capabilities"
FIXTURES = ["local-2cpu", "single-node-64t", "two-socket-128t", "eight-node-512t"]


def load(name: str) -> HostTopology:
    return parse_capabilities((CAPS_DIR / f"{name}.xml").read_text())


def caps(host_body: str) -> str:
    return f"<capabilities><host>{host_body}</host></capabilities>"


# name: (cpus, sockets, cores/socket, threads/core, nodes, memory MiB, 2M hugepages per node)
EXPECTED = {
    "local-2cpu": (2, 1, 2, 1, 1, 24105, [0]),
    "single-node-64t": (64, 1, 32, 2, 1, 256 * 1024, [0]),
    "two-socket-128t": (128, 2, 32, 2, 2, 512 * 1024, [0, 0]),
    "eight-node-512t": (512, 8, 32, 2, 8, 2 * 1024 * 1024, [65536] * 4 + [32768] * 2 + [0] * 2),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_counts(name: str) -> None:
    topo = load(name)
    cpus, sockets, cores, threads, nodes, memory, hugepages = EXPECTED[name]
    assert topo.cpu_count == cpus
    assert topo.sockets == sockets
    assert topo.cores_per_socket == cores
    assert topo.threads_per_core == threads
    assert len(topo.nodes) == nodes
    assert topo.memory_mib == memory
    assert [n.hugepages_2m for n in topo.nodes] == hugepages
    assert len(topo.physical_cores()) == sockets * cores
    assert sum(len(n.cpus) for n in topo.nodes) == cpus


@pytest.mark.parametrize("name", FIXTURES)
def test_physical_cores_partition_cpus(name: str) -> None:
    topo = load(name)
    cores = topo.physical_cores()
    flat = [c for core in cores for c in core]
    assert sorted(flat) == sorted(cpu.id for cpu in topo.cpus)
    assert len(flat) == len(set(flat))
    by_id = {cpu.id: cpu for cpu in topo.cpus}
    for core in cores:
        assert list(core) == sorted(core)
        assert len(core) == topo.threads_per_core
        for cpu_id in core:
            assert by_id[cpu_id].siblings == core
            assert by_id[cpu_id].node == by_id[core[0]].node
            assert by_id[cpu_id].socket == by_id[core[0]].socket
    keys = [(by_id[c[0]].node, by_id[c[0]].socket, by_id[c[0]].core, c[0]) for c in cores]
    assert keys == sorted(keys)


def test_sibling_layouts() -> None:
    assert load("single-node-64t").physical_cores() == [(i, i + 32) for i in range(32)]
    two = load("two-socket-128t")
    assert two.physical_cores()[:2] == [(0, 64), (1, 65)]
    assert two.physical_cores()[32] == (32, 96)
    assert two.nodes[0].cpus == tuple(range(32)) + tuple(range(64, 96))
    assert load("local-2cpu").physical_cores() == [(0,), (1,)]


def test_sockets_counted_from_cells_not_cpu_topology() -> None:
    # libvirt's <cpu><topology sockets=> is per NUMA node; the fixture says sockets='1'.
    assert "sockets='1'" in (CAPS_DIR / "two-socket-128t.xml").read_text()
    assert load("two-socket-128t").sockets == 2


def test_libvirt_test_driver() -> None:
    libvirt = pytest.importorskip("libvirt")
    conn = libvirt.open("test:///default")
    try:
        topo = parse_capabilities(conn.getCapabilities())
    finally:
        conn.close()
    assert topo.cpu_count == 16
    assert (topo.sockets, topo.cores_per_socket, topo.threads_per_core) == (2, 8, 1)
    assert [n.cpus for n in topo.nodes] == [tuple(range(8)), tuple(range(8, 16))]
    assert [n.memory_mib for n in topo.nodes] == [2048, 4096]
    assert topo.physical_cores() == [(i,) for i in range(16)]


def test_no_cells_falls_back_to_one_node() -> None:
    topo = parse_capabilities(
        caps("<cpu><arch>x86_64</arch><topology sockets='2' dies='1' cores='4' threads='2'/></cpu>")
    )
    assert topo.cpu_count == 16
    assert (topo.sockets, topo.cores_per_socket, topo.threads_per_core) == (2, 4, 2)
    assert len(topo.nodes) == 1
    assert topo.nodes[0].cpus == tuple(range(16))
    assert topo.memory_mib == 0
    assert topo.physical_cores()[0] == (0, 8)
    assert {cpu.socket for cpu in topo.cpus if cpu.id in (4, 12)} == {1}


def test_empty_topology_element_falls_back() -> None:
    topo = parse_capabilities(
        caps("<cpu><topology sockets='1' cores='2' threads='1'/></cpu><topology><cells num='0'/></topology>")
    )
    assert topo.cpu_count == 2


def test_offline_cpus_are_skipped() -> None:
    xml = caps(
        "<topology><cells num='1'><cell id='0'><memory unit='KiB'>2097152</memory><cpus num='4'>"
        "<cpu id='0' socket_id='0' die_id='0' core_id='0' siblings='0-1'/>"
        "<cpu id='1' socket_id='0' die_id='0' core_id='0' siblings='0-1'/>"
        "<cpu id='2'/>"
        "<cpu id='3' socket_id='0' die_id='0' core_id='1' siblings='3'/>"
        "</cpus></cell></cells></topology>"
    )
    topo = parse_capabilities(xml)
    assert [c.id for c in topo.cpus] == [0, 1, 3]
    assert topo.physical_cores() == [(0, 1), (3,)]
    assert topo.threads_per_core == 2
    assert topo.nodes[0].memory_mib == 2048


def test_memory_units_and_hugepages() -> None:
    xml = caps(
        "<topology><cells num='1'><cell id='0'><memory unit='GiB'>4</memory>"
        "<pages unit='KiB' size='4'>100</pages><pages unit='MiB' size='2'>7</pages>"
        "<cpus num='1'><cpu id='0' socket_id='0' core_id='0' siblings='0'/></cpus>"
        "</cell></cells></topology>"
    )
    node = parse_capabilities(xml).nodes[0]
    assert (node.memory_mib, node.hugepages_2m) == (4096, 7)


@pytest.mark.parametrize(
    ("xml", "fragment"),
    [
        ("<capabilities><host>", "not valid XML"),
        ("<domain/>", "root element"),
        ("<capabilities/>", "no <host>"),
        (caps("<cpu><arch>x86_64</arch></cpu>"), "no <topology>"),
        (caps("<topology><cells num='0'/></topology>"), "<topology>"),
        (
            caps(
                "<topology><cells><cell id='0'><cpus><cpu id='0' socket_id='x' core_id='0'/></cpus></cell>"
                "</cells></topology>"
            ),
            "socket_id",
        ),
        (
            caps(
                "<topology><cells><cell id='0'><cpus><cpu id='0' socket_id='0' core_id='0' siblings='a'/>"
                "</cpus></cell></cells></topology>"
            ),
            "invalid CPU list",
        ),
        (
            caps(
                "<topology><cells><cell id='0'><memory unit='parsec'>1</memory><cpus>"
                "<cpu id='0' socket_id='0' core_id='0'/></cpus></cell></cells></topology>"
            ),
            "unknown unit",
        ),
    ],
)
def test_malformed_capabilities(xml: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_capabilities(xml)
    assert fragment in str(info.value)


def test_cpuset_strings() -> None:
    assert parse_cpuset("0-3,8,^2") == (0, 1, 3, 8)
    assert parse_cpuset("0,32") == (0, 32)
    assert format_cpuset([32, 0, 1, 2]) == "0-2,32"
    assert format_cpuset([]) == ""
    with pytest.raises(ConfigError):
        parse_cpuset("3-1")


@given(st.sets(st.integers(min_value=0, max_value=600)))
def test_cpuset_round_trip(ids: set[int]) -> None:
    assert parse_cpuset(format_cpuset(ids)) == tuple(sorted(ids))


def test_sandbox_standby_hosts_start_half_way_along_the_machine(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox's hosts share one machine: its standby hosts' slots start half-way along its
    cores, so an instance's standbys do not run on its primary's core."""
    from pgcarve.sandbox import hosts as sandbox_hosts

    monkeypatch.setattr(sandbox_hosts, "machine_cores_per_socket", lambda: 2)
    config = sandbox_hosts.Sandbox(tmp_path / "sandbox").fleet_config(3)
    assert [(h.role, h.core_offset) for h in config.hosts] == [("primary", 0), ("standby", 1), ("standby", 1)]
    assert sandbox_hosts.Sandbox(tmp_path / "other").fleet_config(1).hosts[0].core_offset == 0
