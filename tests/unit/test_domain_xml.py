"""Domain XML: golden files, libvirt's own validation on the test driver, metadata round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pgcarve.errors import ConfigError
from pgcarve.virt.domain_xml import (
    Disk,
    DomainSpec,
    InstanceMetadata,
    Nic,
    mac_for,
    vcpu_pins_from_xml,
)
from pgcarve.virt.host import LibvirtHost

from tests.support.domains import TEST_URI, reset_test_driver

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "domain_xml"


def spec(name: str = "pgc-01", **changes: object) -> DomainSpec:
    fields: dict[str, object] = dict(
        name=name,
        domain_type="qemu",
        metadata=InstanceMetadata(fleet="pgc", cluster=name, role="primary", index=1),
        memory_mib=1024,
        vcpu_pins=(2, 3),
        emulator_cpus=(0, 1),
        numa_node=0,
        kernel="/var/lib/libvirt/pgcarve/pgcarve-vmlinuz-abc",
        initrd="/var/lib/libvirt/pgcarve/pgcarve-initrd-abc",
        disks=(Disk("vda", "default", f"{name}.qcow2"),
               Disk("vdb", "default", f"{name}-seed.iso", format="raw", readonly=True)),
        nics=(Nic("default", mac_for("pgc", name)),),
    )
    fields.update(changes)
    return DomainSpec(**fields)  # type: ignore[arg-type]


CASES = {
    "primary-tcg": spec(),
    "standby-kvm-hugepages": spec(
        "pgc-01-s1", domain_type="kvm", hugepages=True, vcpu_pins=(8, 72), emulator_cpus=(0, 64), numa_node=1,
        metadata=InstanceMetadata(fleet="pgc", cluster="pgc-01", role="standby", index=1, standby=1),
    ),
    "no-numa": spec("pgc-07", numa_node=None, vcpu_pins=(5,), emulator_cpus=tuple(range(8)),
                    metadata=InstanceMetadata(fleet="pgc", cluster="pgc-07", role="primary", index=7)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, regenerate: bool) -> None:
    golden = GOLDEN / f"{case}.xml"
    rendered = CASES[case].to_xml()
    if regenerate:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(rendered)
    assert rendered == golden.read_text(), "domain XML changed: review it, then rerun with --regenerate-output"


@pytest.mark.parametrize("case", sorted(CASES))
def test_libvirt_accepts_and_keeps_pinning(case: str) -> None:
    # test:///default is shared by the whole process: a pgc-01 another test left there (kept alive
    # by any connection not yet closed) would refuse this one's definition.
    conn = reset_test_driver()
    try:
        s = CASES[case]
        dom = conn.defineXML(s.to_xml())
        xml = dom.XMLDesc(0)
        pins, emulator = vcpu_pins_from_xml(xml)
        assert pins == s.vcpu_pins
        assert emulator == tuple(sorted(s.emulator_cpus))
        assert InstanceMetadata.from_domain_xml(xml) == s.metadata
        dom.undefine()
    finally:
        conn.close()


def test_metadata_round_trip_through_libvirt_host() -> None:
    reset_test_driver().close()  # emptied; the host's own connection below sees it so
    host = LibvirtHost("t", TEST_URI)
    conn = host.conn
    s = spec("pgc-03", vcpu_pins=(1,), emulator_cpus=(0,),
             metadata=InstanceMetadata(fleet="pgc", cluster="pgc-03", role="primary", index=3))
    dom = conn.defineXML(s.to_xml())
    try:
        dom.create()
        found = [g for g in host.guests("pgc") if g.name == "pgc-03"]
        assert len(found) == 1
        info = found[0]
        assert info.metadata == s.metadata
        assert info.state == "running"
        assert info.vcpu_pins == ((1,),)
        assert info.memory_mib == 1024
        assert host.guests("other") == [], "another fleet's view must not see it"
        assert host.destroy("pgc-03") is True
        assert [g for g in host.guests() if g.name == "pgc-03"] == []
    finally:
        host.close()


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"name": "Bad Name"}, "name"),
        ({"name": "x; rm -rf /"}, "name"),
        ({"vcpu_pins": ()}, "at least one vCPU"),
        ({"vcpu_pins": (1, 1)}, "same host CPU"),
        ({"memory_mib": 64}, "memory"),
        ({"nics": (Nic("default", "aa:bb:cc:dd:ee:ff"),)}, "MAC"),
        ({"disks": (Disk("sda", "default", "x.qcow2"),)}, "disk target"),
        ({"disks": (Disk("vda", "default", "../etc/passwd"),)}, "pool/volume"),
    ],
)
def test_invalid_specs_are_refused(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        spec(**changes)


def test_user_text_is_escaped() -> None:
    # A title is the only free text; ElementTree escapes it rather than pasting markup.
    xml = spec(title="</title><evil/>").to_xml()
    assert "<evil/>" not in xml and "&lt;/title&gt;&lt;evil/&gt;" in xml


def test_metadata_validation() -> None:
    with pytest.raises(ConfigError):
        InstanceMetadata(fleet="Bad", cluster="pgc-01", role="primary", index=1)
    with pytest.raises(ConfigError):
        InstanceMetadata(fleet="pgc", cluster="pgc-01", role="standby", index=1, standby=0)
