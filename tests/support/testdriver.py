"""Stand-ins that let the real fleet, provisioning and scaler run on libvirt's test driver, where
no guest boots (used by the control-plane benchmark, bench/control_plane.py).

Only what the test driver cannot do, or what needs a booted guest, is replaced:

* a node file's host reports `<cells num='0'>` (only test:///default has NUMA cells): the
  topology comes from a capabilities XML given to TestDriverHost;
* its pools are fixed at 100 GiB: overlays are declared as 1 GiB (only a number in the volume
  XML; the call is the real one);
* it has no virStorageVolUpload: uploads create empty volumes of the file's size, and the image
  is one empty qcow2 volume (its kernel and initrd are never read);
* its vcpuPinInfo covers CPUs 0-7 only (virNodeGetCPUMap is hard-coded to 8): pins are read back
  from the domain XML (TestDriverHost.domain_xml);
* no PostgreSQL answers: `accepts_sql_at_once` is the provisioner's readiness.

They go through the product's public seams (Fleet(hosts=...), Provisioner(ready=...)) and
public methods only. This module does not import libvirt: only pgcarve's virt package does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pgcarve.config import FleetConfig, HostConfig
from pgcarve.control.fleet import Fleet, Guest, Progress
from pgcarve.control.provisioning import Readiness
from pgcarve.settings import Paths
from pgcarve.statedir.layout import make_fleet_secrets
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.storage import BaseImage, HostStorage
from pgcarve.virt.xml_specs import VolumeSpec

OVERLAY_GIB = 1  # 62 overlays fit a test-driver pool of 100 GiB
BASE_GIB = 2
IMAGE_TAG = "testdriver00"  # stand_in_image's image.tag


class TestDriverStorage(HostStorage):
    """A test-driver pool: uploads become empty volumes, overlays are 1 GiB."""

    __test__ = False  # a stand-in, not a pytest test class

    def create_overlay(self, name: str, base_volume: str, size_gib: int) -> None:
        super().create_overlay(name, base_volume, OVERLAY_GIB)

    def upload_file(self, name: str, source: Path) -> None:
        self.delete_volume(name)
        self.create_empty(name, source.stat().st_size, "raw")

    def upload_image(self, tag: str, base: Path, kernel: Path, initrd: Path) -> BaseImage:
        disk = f"pgcarve-base-{tag}.qcow2"
        if disk not in self.volume_names():
            self.create_empty(disk, BASE_GIB << 30, "qcow2")
        return BaseImage(disk=disk, kernel_path="/nonexistent/vmlinuz", initrd_path="/nonexistent/initrd.img")

    def create_empty(self, name: str, size_bytes: int, fmt: Literal["qcow2", "raw"]) -> None:
        """A new volume of `size_bytes` holding nothing."""
        spec = VolumeSpec(name, size_bytes, format=fmt)
        with self.host.translate(f"creating the empty volume {name}"):
            self.ensure_pool().createXML(spec.to_xml(), 0)


class TestDriverHost(LibvirtHost):
    """A LibvirtHost on a test-driver URI whose topology comes from `capabilities` (XML as
    `virsh capabilities` prints it) and whose storage is a TestDriverStorage."""

    __test__ = False

    def __init__(self, name: str, uri: str, capabilities: str, pool: str = "pgcarve",
                 pool_path: str = "/var/lib/libvirt/pgcarve"):
        super().__init__(name, uri, pool, pool_path)
        self.capabilities_xml = capabilities
        self.storage = TestDriverStorage(self, pool, pool_path)

    def capabilities(self) -> str:
        return self.capabilities_xml

    def domain_xml(self, name: str) -> str:
        """The domain's XML as libvirt keeps it (its pins, where vcpuPinInfo cannot show them)."""
        with self.translate(f"reading {name}'s XML"):
            return str(self.conn.lookupByName(name).XMLDesc(0))


def stand_in_image(directory: Path) -> Path:
    """An image directory that passes LocalImage.check(): empty files, an inputs.sha256 and the
    build tag IMAGE_TAG. Only TestDriverStorage.upload_image ever sees it (and reads none of it)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("base.qcow2", "vmlinuz", "initrd.img"):
        (directory / name).touch()
    (directory / "inputs.sha256").write_text(IMAGE_TAG + "0" * (64 - len(IMAGE_TAG)) + "\n")
    (directory / "image.tag").write_text(IMAGE_TAG + "\n")
    return directory


def testdriver_fleet(config: FleetConfig, paths: Paths, capabilities: str) -> Fleet:
    """The real Fleet over a TestDriverHost per configured host (paths.image_dir: stand_in_image),
    with the admin password and CA a new fleet gets when it first starts (if they are not there)."""
    hosts = {h.name: TestDriverHost(h.name, h.uri, capabilities, h.pool, h.pool_path) for h in config.hosts}
    make_fleet_secrets(paths)
    return Fleet(config, paths, hosts=hosts)


def testdriver_hosts(fleet: Fleet) -> dict[str, TestDriverHost]:
    """A testdriver_fleet's hosts, typed as what they are."""
    hosts = {}
    for name, host in fleet.hosts.items():
        if not isinstance(host, TestDriverHost):
            raise TypeError(f"host {name} is a {type(host).__name__}, not a TestDriverHost")
        hosts[name] = host
    return hosts


def accepts_sql_at_once(fleet: Fleet) -> Readiness:
    """A provisioner's readiness for guests that never boot: the guest as libvirt lists it, with
    no address, at once."""

    def ready(host: HostConfig, name: str, _progress: Progress, _standby: bool | None) -> Guest:
        return Guest(info=fleet.hosts[host.name].guest(name), address=None, endpoint=None)

    return ready
