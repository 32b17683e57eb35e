"""The other libvirt objects pgcarve defines (pool, volume, network, KVM probe domain): golden
files, libvirt's own test driver accepting each, and bad values refused before any XML exists."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import libvirt
import pytest
from pgcarve.errors import ConfigError
from pgcarve.virt.xml_specs import NetworkSpec, PoolSpec, ProbeDomainSpec, VolumeSpec

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "xml_specs"

POOL = PoolSpec("pgcarve", "/var/lib/libvirt/pgcarve")
NETWORK = NetworkSpec("pgcarve", "pgcbr0", "10.77.1.1", 24, "10.77.1.10", "10.77.1.250")
CASES: dict[str, PoolSpec | VolumeSpec | NetworkSpec | ProbeDomainSpec] = {
    "pool": POOL,
    "volume-upload": VolumeSpec("pgc-01-seed.iso", 374784, format="raw"),
    "volume-overlay": VolumeSpec("pgc-01.qcow2", 8, unit="GiB", format="qcow2",
                                 backing_path="/var/lib/libvirt/pgcarve/pgcarve-base-0123456789ab.qcow2"),
    "network": NETWORK,
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
    """Defined on libvirt's test driver, so libvirt itself parses and validates them."""
    conn = libvirt.open("test:///default")
    try:
        # Names (and a pool path) of their own: test:///default is shared by every test here.
        pool = conn.storagePoolDefineXML(
            replace(POOL, name="spec-check-pool", path="/spec-check/pool").to_xml(), 0)
        try:
            pool.create(0)
            upload = pool.createXML(CASES["volume-upload"].to_xml(), 0)
            assert upload.name() == "pgc-01-seed.iso"
            assert upload.info()[1] == 374784
            upload.delete(0)
        finally:
            pool.destroy()
            pool.undefine()
        net = conn.networkDefineXML(replace(NETWORK, name="spec-check-net", bridge="speccheck0").to_xml())
        assert net.name() == "spec-check-net" and "10.77.1.250" in net.XMLDesc(0)
        net.undefine()
        probe_spec = replace(CASES["probe-domain"], name="spec-check-probe")
        probe = conn.createXML(probe_spec.to_xml().replace("type=\"kvm\"", "type=\"test\""), 0)
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
