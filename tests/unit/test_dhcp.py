"""Fixed DHCP addresses for new primaries (virt/dhcp.py, LibvirtHost.reserve_address), against
libvirt's test driver: its networks take virNetworkUpdate as a real host's do."""

from __future__ import annotations

from collections.abc import Iterator

import libvirt
import pytest
from pgcarve.virt.dhcp import DhcpSection
from pgcarve.virt.host import LibvirtHost

NETWORK = """<network><name>{name}</name><bridge name='{name}'/>
  <ip address='10.77.9.1' prefix='24'><dhcp><range start='10.77.9.10' end='10.77.9.13'/>{hosts}</dhcp></ip>
</network>"""


@pytest.fixture
def host() -> Iterator[LibvirtHost]:
    lv = LibvirtHost("t", "test:///default")
    made: list[libvirt.virNetwork] = []

    def network(name: str, hosts: str = "", dhcp: bool = True) -> None:
        xml = NETWORK.format(name=name, hosts=hosts)
        if not dhcp:
            xml = xml.replace("<dhcp><range start='10.77.9.10' end='10.77.9.13'/></dhcp>", "")
        net = lv.conn.networkDefineXML(xml)
        net.create()
        made.append(net)

    lv.network = network  # type: ignore[attr-defined]
    yield lv
    for net in made:
        net.destroy()
        net.undefine()
    lv.close()


def reserved(lv: LibvirtHost, network: str) -> dict[str, str]:
    section = DhcpSection.parse(lv.conn.networkLookupByName(network).XMLDesc(0))
    assert section is not None
    return section.hosts


def test_addresses_count_down_from_the_range_end_skip_others_and_stay_with_their_mac(host: LibvirtHost) -> None:
    host.network("pgcd1", hosts="<host mac='52:54:00:aa:aa:aa' ip='10.77.9.12'/>")  # type: ignore[attr-defined]
    assert host.reserve_address("pgcd1", "52:54:00:00:00:01") == "10.77.9.13"
    assert host.reserve_address("pgcd1", "52:54:00:00:00:02") == "10.77.9.11"  # .12 is someone else's
    assert host.reserve_address("pgcd1", "52:54:00:00:00:01") == "10.77.9.13"  # the same MAC: the same one
    assert reserved(host, "pgcd1") == {"52:54:00:aa:aa:aa": "10.77.9.12", "52:54:00:00:00:01": "10.77.9.13",
                                       "52:54:00:00:00:02": "10.77.9.11"}
    assert host.reserve_address("pgcd1", "52:54:00:00:00:03") == "10.77.9.10"
    assert host.reserve_address("pgcd1", "52:54:00:00:00:04") is None  # the range is full
    host.release_address("pgcd1", "52:54:00:00:00:01")
    host.release_address("pgcd1", "52:54:00:00:00:09")  # never had one: nothing to do
    assert "52:54:00:00:00:01" not in reserved(host, "pgcd1")
    assert host.reserve_address("pgcd1", "52:54:00:00:00:04") == "10.77.9.13"


def test_a_network_without_dhcp_reserves_nothing(host: LibvirtHost) -> None:
    host.network("pgcd2", dhcp=False)  # type: ignore[attr-defined]
    assert host.reserve_address("pgcd2", "52:54:00:00:00:01") is None


def test_leased_addresses_are_not_chosen() -> None:
    section = DhcpSection.parse(NETWORK.format(name="n", hosts=""))
    assert section is not None
    assert section.choose({"10.77.9.13", "10.77.9.12"}) == "10.77.9.11"
