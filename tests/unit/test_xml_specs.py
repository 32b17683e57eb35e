"""The other libvirt objects pgcarve defines (pool, volume, network, KVM probe domain): golden
files, libvirt's own test driver accepting each, and bad values refused before any XML exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import libvirt
import pytest
from pgcarve.errors import ConfigError
from pgcarve.virt.xml_specs import NetworkSpec, PoolSpec, ProbeDomainSpec, VolumeSpec

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "xml_specs"

CASES: dict[str, PoolSpec | VolumeSpec | NetworkSpec | ProbeDomainSpec] = {
    "pool": PoolSpec("pgcarve", "/var/lib/libvirt/pgcarve"),
    "volume-upload": VolumeSpec("pgc-01-seed.iso", 374784, format="raw"),
    "volume-overlay": VolumeSpec("pgc-01.qcow2", 8, unit="GiB", format="qcow2",
                                 backing_path="/var/lib/libvirt/pgcarve/pgcarve-base-0123456789ab.qcow2"),
    "network": NetworkSpec("pgcarve", "pgcbr0", "10.77.1.1", 24, "10.77.1.10", "10.77.1.250"),
    "probe-domain": ProbeDomainSpec("pgcarve-kvm-probe-1a2b3c4d", "/var/lib/libvirt/pgcarve/pgcarve-vmlinuz-abc",
                                    "/var/lib/libvirt/pgcarve/pgcarve-initrd-abc"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, regenerate: bool) -> None:
    golden = GOLDEN / f"{case}.xml"
    rendered = CASES[case].to_xml()
    if regenerate:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
    assert rendered == golden.read_text(), "XML changed: review it, then rerun with --regenerate-output"


def test_libvirt_accepts_each() -> None:
    """Defined on libvirt's test driver, so libvirt itself parses and validates them.

    test:///default is one state shared by every connection in this process, and other tests
    leave a "pgcarve" pool and network on it: the objects here get names of their own."""
    pool_spec = dataclasses.replace(CASES["pool"], name="pgcarve-xml-check",
                                    path="/var/lib/libvirt/pgcarve-xml-check")
    network_spec = dataclasses.replace(CASES["network"], name="pgcarve-xml-check", bridge="pgcxmlbr0")
    conn = libvirt.open("test:///default")
    try:
        pool = conn.storagePoolDefineXML(pool_spec.to_xml(), 0)
        try:
            pool.create(0)
            upload = pool.createXML(CASES["volume-upload"].to_xml(), 0)
            assert upload.name() == "pgc-01-seed.iso"
            assert upload.info()[1] == 374784
            upload.delete(0)
        finally:
            pool.destroy()
            pool.undefine()
        net = conn.networkDefineXML(network_spec.to_xml())
        assert net.name() == "pgcarve-xml-check" and "10.77.1.250" in net.XMLDesc(0)
        net.undefine()
        probe = conn.createXML(CASES["probe-domain"].to_xml().replace("type=\"kvm\"", "type=\"test\""), 0)
        assert probe.isActive()
        probe.destroy()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: PoolSpec("pg carve", "/x"), "storage pool name"),
        (lambda: PoolSpec("pgcarve", "relative/path"), "absolute path"),
        (lambda: PoolSpec("pgcarve", "/var/lib/../../etc"), "absolute path"),
        (lambda: VolumeSpec("../../etc/passwd", 1), "volume name"),
        (lambda: VolumeSpec("v.qcow2", -1), "capacity"),
        (lambda: VolumeSpec("v.qcow2", 1, backing_path="/a b"), "backing file"),
        (lambda: NetworkSpec("pgcarve", "Bad Bridge", "10.0.0.1", 24, "10.0.0.2", "10.0.0.9"), "bridge"),
        (lambda: NetworkSpec("pgcarve", "br0", "10.0.0.1", 24, "10.0.1.2", "10.0.1.9"), "outside"),
        (lambda: NetworkSpec("pgcarve", "br0", "10.0.0.1", 99, "10.0.0.2", "10.0.0.9"), "network pgcarve"),
        (lambda: ProbeDomainSpec("Probe!", "/k", "/i"), "probe domain name"),
        (lambda: ProbeDomainSpec("probe", "/k'><x/>", "/i"), "probe kernel"),
    ],
)
def test_bad_values_are_refused(make: object, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        make()  # type: ignore[operator]
