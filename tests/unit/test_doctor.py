"""`pgcarve doctor` on libvirt's test driver (test:///default: 16 CPUs on 2 NUMA nodes, a NAT
network "default" 192.168.122.0/24, a pool "default-pool" of 100 GiB at /default-pool).

Every test driver connection of this process shares one state, so the networks a test defines
are removed after it. This machine's routes are never looked up here: the route lookup is a
stand-in (`Doctor(route=...)`), or the host is reached the sandbox's way (no lookup at all).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pgcarve.cli.main import main
from pgcarve.config import FleetConfig, HostConfig, InstanceSize, Replication
from pgcarve.control import doctor as doctor_module
from pgcarve.control.doctor import Doctor
from pgcarve.control.doctor_network import Route
from pgcarve.control.doctor_report import Finding, summary
from pgcarve.control.fleet import Fleet
from pgcarve.settings import Paths
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.xml_specs import NetworkSpec

from tests.support import testdriver

TEST_URI = "test:///default"
UNREACHABLE_URI = "qemu+unix:///system?socket=/nonexistent/pgcarve-doctor.sock"


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def driver() -> Iterator[LibvirtHost]:
    """A connection that keeps the test driver's state while the test runs; it removes the
    networks the test defined (NetworkSpec: routed "open" networks with DHCP, autostarted)."""
    host = LibvirtHost("driver", TEST_URI)
    before = {net.name() for net in host.conn.listAllNetworks(0)}
    yield host
    for net in host.conn.listAllNetworks(0):
        if net.name() not in before:
            if net.isActive():
                net.destroy()
            net.undefine()
    host.close()


def network(driver: LibvirtHost, name: str, third: int, first: int = 10, last: int = 250, prefix: int = 24) -> str:
    driver.ensure_network(NetworkSpec(name, f"virbrdoc{third}", f"10.91.{third}.1", prefix,
                                      f"10.91.{third}.{first}", f"10.91.{third}.{last}"))
    return name


def host(name: str = "t0", **fields: Any) -> HostConfig:
    values: dict[str, Any] = {"name": name, "uri": TEST_URI, "network": "docnet", "pool": "default-pool",
                              "pool_path": "/default-pool", **fields}
    return HostConfig(**values)


def config(*hosts: HostConfig, standbys: int = 0, domain_type: str = "qemu", **size: Any) -> FleetConfig:
    return FleetConfig(
        fleet="doc",
        domain_type=domain_type,
        instance=InstanceSize(**{"vcpus": 2, "memory_mib": 512, **size}),
        replication=Replication(standbys=standbys),
        hosts=list(hosts) or [host()],
    )


class Routes:
    """A stand-in for this machine's routing table: every address routed, or none; records the
    addresses asked about."""

    def __init__(self, found: bool = True):
        self.found = found
        self.asked: list[str] = []

    def __call__(self, address: str) -> Route:
        self.asked.append(address)
        return Route(True, "dev brguests") if self.found else Route(False, "RTNETLINK answers: Network is unreachable")


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    return Paths(tmp_path / "state", tmp_path / "image")


def examine(fleet_config: FleetConfig, paths: Paths, routes: Routes | None = None, **kwargs: Any) -> list[Finding]:
    fleet = Fleet(fleet_config, paths)
    try:
        return Doctor(fleet, route=routes or Routes(), **kwargs).run()
    finally:
        fleet.close()


def only(findings: list[Finding], check: str, status: str | None = None, host_name: str = "t0") -> Finding:
    (found,) = [f for f in findings if f.host == host_name and f.check == check
                and (status is None or f.status == status)]
    return found


def fails(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "fail"]


# -- one host ----------------------------------------------------------------------------------


def test_a_healthy_host_is_ok_or_warned_about_and_nothing_fails(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 1)
    routes = Routes()
    findings = examine(config(), paths, routes)
    assert fails(findings) == []
    assert {f.check for f in findings if f.host == "t0"} == {
        "connect", "libvirt", "kvm", "capacity", "numa", "cpus", "pool", "network", "route"}
    assert only(findings, "libvirt", "ok").message.endswith("(pgcarve needs 8.0.0 or newer)")
    assert "domain_type: qemu" in only(findings, "kvm", "warn").message  # emulation is a warning, not a failure
    assert only(findings, "scale", host_name="(fleet)").message == (
        "counts below are for a scale to 6 instances (the fleet's capacity)")
    assert "3 instances planned; node 1: CPUs 8-15" in only(findings, "numa", "ok").message
    cpus = only(findings, "cpus", "warn").message
    assert "not checked over libvirt" in cpus and "isolcpus=managed_irq,domain,1-7,9-15 nohz_full=1-7,9-15" in cpus
    pool = only(findings, "pool", "ok").message
    assert "102400 MiB free; the 6 guests that a scale to 6 starts there need 6144 MiB" in pool
    assert "10.91.1.10-10.91.1.250 (241 addresses) in 10.91.1.0/24" in only(findings, "network", "ok").message
    assert only(findings, "route", "ok").message.startswith("this machine routes t0's guest subnet 10.91.1.0/24")
    assert routes.asked == ["10.91.1.10"]  # looked up, once, in the guest subnet
    # The fourth warning: the hosts file names no etcd (control/doctor_etcd.py, tests/unit/test_etcd.py).
    assert "no etcd section in the hosts file" in only(findings, "etcd", "warn", host_name="(etcd)").message
    assert summary(findings, 1) == "1 host checked: nothing that would make a scale fail; 4 warnings"


def test_a_missing_network_fails_naming_it(driver: LibvirtHost, paths: Paths) -> None:
    findings = examine(config(host(network="nosuchnet")), paths)
    (failed,) = fails(findings)
    assert failed.check == "network"
    assert failed.headline == "network nosuchnet is not defined on t0"
    assert "virsh net-define" in failed.message
    assert not [f for f in findings if f.check == "route"]  # no subnet to look a route up for


def test_a_dhcp_range_smaller_than_the_scale_fails_naming_range_and_count(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 2, first=10, last=11)
    assert fails(examine(config(), paths, instances=2)) == []
    (failed,) = fails(examine(config(), paths, instances=3))
    assert failed.headline == ("network docnet on t0 hands out 10.91.2.10-10.91.2.11 (2 addresses), fewer than the "
                               "3 guests that a scale to 3 puts there")
    # By default the fleet's capacity (6 here) is what must fit.
    (failed,) = fails(examine(config(), paths))
    assert "fewer than the 6 guests that a scale to 6 puts there" in failed.message


def test_terraforms_reserved_addresses_beyond_the_range_are_a_warning(driver: LibvirtHost, paths: Paths) -> None:
    """A second primary host holds instances 7.. : its 6 guests fit 6 addresses, but Terraform
    gives instance i the i-th address from the end."""
    network(driver, "docnet", 3, first=10, last=15)
    findings = examine(config(host("t0"), host("t1")), paths)
    assert fails(findings) == []
    assert "instance 12 has a guest here" in only(findings, "network", "warn", host_name="t1").message


def test_a_nat_network_fails_only_where_guests_are_reached_from_elsewhere(driver: LibvirtHost, paths: Paths) -> None:
    alone = examine(config(host(network="default")), paths)  # no standbys, the manager on the host
    assert [f for f in alone if f.check == "network" and "forward mode" in f.message] == []
    network(driver, "docnet", 4)
    replicated = examine(config(host(network="default"), host("s0", role="standby"), standbys=1), paths)
    (failed,) = fails(replicated)
    assert failed.headline == "network default on t0 accepts no connections from other machines (forward mode nat)"


def test_no_route_from_this_machine_fails(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 5)
    (failed,) = fails(examine(config(), paths, Routes(found=False)))
    assert failed.check == "route"
    assert failed.headline == "this machine has no route to t0's guest subnet 10.91.5.0/24"
    assert "Network is unreachable" in failed.message


def test_overlapping_guest_subnets_of_two_hosts_fail(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 6)
    driver.ensure_network(NetworkSpec("docnet2", "virbrdoc62", "10.91.6.129", 25, "10.91.6.130", "10.91.6.250"))
    findings = examine(config(host("t0"), host("s0", role="standby", network="docnet2"), standbys=1), paths)
    (failed,) = fails(findings)
    assert (failed.host, failed.check) == ("s0", "subnets")
    assert failed.headline == "guest subnet 10.91.6.128/25 of s0 overlaps t0's 10.91.6.0/24"
    assert "not checked over libvirt" in only(findings, "subnets", "warn", host_name="(fleet)").message


def test_a_pool_without_the_reserve_for_the_scale_fails(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 7)
    (failed,) = fails(examine(config(disk_reserve_mib=20000), paths))
    assert failed.headline == "storage pool default-pool (/default-pool) on t0 has 102400 MiB free"
    assert "6 guests that a scale to 6 starts there need 120000 MiB (20000 MiB each" in failed.message
    assert fails(examine(config(disk_reserve_mib=20000), paths, instances=5)) == []
    missing = only(examine(config(host(pool="nosuchpool")), paths), "pool", "warn")
    assert "virsh pool-define-as nosuchpool dir --target /default-pool" in missing.message


def test_hugepages_asked_without_pages_fail(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 8)
    findings = examine(config(hugepages=True), paths)
    assert only(findings, "hugepages", "fail").headline == (
        "instance.hugepages is true but t0 has no 2 MiB hugepages configured")
    assert only(findings, "capacity", "fail").headline == "t0 cannot hold even one instance"
    assert "0 configured 2 MiB hugepages" in only(findings, "capacity").message  # the planner's reason


def with_hugepages(pages: int) -> str:
    """test:///default's capabilities with `pages` 2 MiB pages configured on node 0."""
    xml = LibvirtHost("caps", TEST_URI).capabilities()
    return xml.replace("<pages unit='KiB' size='2048'>0</pages>", f"<pages unit='KiB' size='2048'>{pages}</pages>", 1)


def test_hugepages_are_counted_per_node_against_the_guests_to_start(
        driver: LibvirtHost, paths: Paths, monkeypatch: pytest.MonkeyPatch) -> None:
    network(driver, "docnet", 9)
    fleet = testdriver.testdriver_fleet(config(hugepages=True), paths, with_hugepages(512))  # 256 pages a guest: 2 fit
    try:
        findings = Doctor(fleet, route=Routes()).run()
        assert fails(findings) == []
        assert only(findings, "hugepages", "ok").message.startswith(
            "2 MiB hugepages configured (libvirt reports no free count): node 0: 512, node 1: 0")
        # Where libvirt reports free pages, those count: 100 free cannot back 2 guests of 256.
        monkeypatch.setattr(doctor_module, "free_hugepages_2m", lambda _lv, _nodes: {0: 100, 1: 0})
        (failed,) = fails(Doctor(fleet, route=Routes()).run())
        assert failed.message.startswith("not enough 2 MiB hugepages on t0 for a scale to 2: node 0 has 100 free, "
                                         "its 2 guests to start need 512")
    finally:
        fleet.close()


def test_an_unreachable_uri_fails_cannot_connect_with_the_uri(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 10)
    findings = examine(config(host("t0"), host("s0", role="standby", uri=UNREACHABLE_URI), standbys=1), paths)
    failed = only(findings, "connect", "fail", host_name="s0")
    assert failed.headline == f"cannot connect to libvirt at {UNREACHABLE_URI}"
    assert "/nonexistent/pgcarve-doctor.sock" in failed.message.split(": ", 1)[1]
    assert [f.check for f in findings if f.host == "s0"] == ["connect"]  # nothing else asked of it
    assert only(findings, "connect", "ok").message.startswith(f"connected to {TEST_URI}")  # t0 is still checked
    assert only(findings, "scale", "warn", host_name="(fleet)").headline == "counts not checked"


# -- KVM -------------------------------------------------------------------------------------------


def with_kvm() -> str:
    """test:///default's capabilities offering x86_64 guests under KVM."""
    xml = LibvirtHost("caps", TEST_URI).capabilities()
    kvm = "<guest><os_type>hvm</os_type><arch name='x86_64'><domain type='kvm'/></arch></guest>"
    return xml.replace("</capabilities>", f"{kvm}</capabilities>")


def test_kvm_asked_where_libvirt_offers_none_fails(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 11)
    findings = examine(config(domain_type="kvm"), paths)
    assert only(findings, "kvm", "fail").headline == "libvirt on t0 offers no KVM for x86_64 guests"
    assert only(examine(config(domain_type="auto"), paths), "kvm").status == "warn"  # auto falls back to qemu


def test_the_kvm_probe_decides_where_libvirt_offers_kvm(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 12)
    testdriver.stand_in_image(paths.image_dir)
    fleet = testdriver.testdriver_fleet(config(domain_type="kvm"), paths, with_kvm())
    try:
        not_there = only(Doctor(fleet, route=Routes()).run(), "kvm", "warn")
        assert not_there.headline == "KVM is offered on t0 but not probed"  # the image is not on the host: no upload
        assert "pgcarve-base-testdriver00.qcow2" not in fleet.hosts["t0"].storage.volume_names()
        probed: list[str] = []

        def no_banner(lv: LibvirtHost, image: Any) -> tuple[bool, str]:
            probed.append(image.disk)
            return False, "a KVM guest printed no kernel banner in 15 s"

        findings = Doctor(fleet, route=Routes(), upload_image=True, probe=no_banner).run()
        assert probed == ["pgcarve-base-testdriver00.qcow2"]
        assert only(findings, "kvm", "fail").headline == "the KVM probe failed on t0"
        assert only(Doctor(fleet, route=Routes(), upload_image=True,
                           probe=lambda _lv, _image: (True, "a KVM guest printed its kernel banner")).run(),
                    "kvm").status == "ok"
    finally:
        fleet.hosts["t0"].storage.delete_volume("pgcarve-base-testdriver00.qcow2")
        fleet.close()


def test_an_earlier_probe_answer_is_reported_for_auto(driver: LibvirtHost, paths: Paths) -> None:
    network(driver, "docnet", 13)
    paths.probe_cache.parent.mkdir(parents=True)
    paths.probe_cache.write_text(json.dumps({TEST_URI: {"domain_type": "qemu", "why": "KVM guest did not start"}}))
    fleet = testdriver.testdriver_fleet(config(domain_type="auto"), paths, with_kvm())
    try:
        found = only(Doctor(fleet, route=Routes()).run(), "kvm", "warn")
    finally:
        fleet.close()
    assert "the KVM probe failed earlier (KVM guest did not start)" in found.message
    assert str(paths.probe_cache) in found.message


# -- the command line --------------------------------------------------------------------------


def run_cli(tmp_path: Path, fleet_config: FleetConfig, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(json.dumps(fleet_config.model_dump(mode="json")))  # JSON is YAML
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PGCARVE_IMAGE_DIR", str(tmp_path / "image"))
    code = main(["--hosts-file", str(hosts_file), "doctor", *args])
    return code, capsys.readouterr().out


def test_cli_exit_code_and_summary(driver: LibvirtHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    network(driver, "docnet", 14)
    sandboxed = host(reach="sandbox")  # no route lookup: the sandbox wires its hosts
    code, text = run_cli(tmp_path, config(sandboxed), monkeypatch, capsys)
    assert code == 0
    assert text.rstrip().splitlines()[-1] == "1 host checked: nothing that would make a scale fail; 4 warnings"
    assert re.search(r"│ t0\s+│ route\s+│ ok\s+│ reach: sandbox", text)

    broken = config(host(reach="sandbox", network="nosuchnet"), host("s0", role="standby", uri=UNREACHABLE_URI))
    code, text = run_cli(tmp_path, broken, monkeypatch, capsys)
    assert code == 1
    assert text.rstrip().splitlines()[-1] == (
        "2 hosts checked: 2 problems that would make a scale fail (t0: network nosuchnet is not defined on t0; "
        f"s0: cannot connect to libvirt at {UNREACHABLE_URI}); 5 warnings")

    code, text = run_cli(tmp_path, broken, monkeypatch, capsys, "--format", "json")
    document = json.loads(text)
    assert code == 1 and document["fail"] is True
    assert {(f["host"], f["check"]) for f in document["findings"] if f["status"] == "fail"} == {
        ("t0", "network"), ("s0", "connect")}


def test_cli_refuses_an_invalid_hosts_file_with_the_config_exit_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text("hosts: []\n")
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(tmp_path / "state"))
    assert main(["--hosts-file", str(hosts_file), "doctor"]) == 2
