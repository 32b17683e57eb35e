"""One host's storage pool, through libvirt's storage API: pgcarve's volumes live here.

The guest image is uploaded over the libvirt connection itself (no scp, no shared filesystem),
each guest's disk is a qcow2 overlay on it, and its seed is a small uploaded file.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import libvirt

from pgcarve.virt.xml_specs import PoolSpec, VolumeSpec

if TYPE_CHECKING:
    from pgcarve.virt.host import LibvirtHost


def image_tag_of(kernel_path: str) -> str | None:
    """The image version a guest boots, from its kernel volume's path (pgcarve-vmlinuz-<tag>)."""
    found = re.search(r"pgcarve-vmlinuz-([0-9a-z]+)$", kernel_path)
    return found.group(1) if found else None


@dataclass(frozen=True)
class BaseImage:
    """The guest image's volumes on one host."""

    disk: str  # volume name of base.qcow2
    kernel_path: str
    initrd_path: str


class HostStorage:
    """pgcarve's directory pool on one host (``LibvirtHost.storage``)."""

    def __init__(self, host: LibvirtHost, pool: str, pool_path: str):
        self.host = host
        self.pool_name = pool
        self.pool_path = pool_path
        # libvirt refuses concurrent changes to one pool ("pool has asynchronous jobs"): one
        # storage change at a time per host.
        self._lock = threading.RLock()

    def ensure_pool(self, refresh: bool = False) -> libvirt.virStoragePool:
        """pgcarve's directory pool, defined, built, started and autostarted if needed."""
        with self._lock, self.host.translate(f"preparing storage pool {self.pool_name}"):
            try:
                pool = self.host.conn.storagePoolLookupByName(self.pool_name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_STORAGE_POOL:
                    raise
                pool = self.host.conn.storagePoolDefineXML(PoolSpec(self.pool_name, self.pool_path).to_xml(), 0)
                pool.build(0)
                pool.setAutostart(1)
            if not pool.isActive():
                pool.create(0)
            if refresh:
                pool.refresh(0)
            return pool

    def _running_pool(self) -> libvirt.virStoragePool | None:
        """pgcarve's pool if it is defined and running, without defining or starting it."""
        try:
            pool = self.host.conn.storagePoolLookupByName(self.pool_name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_POOL:
                return None
            raise
        return pool if pool.isActive() else None

    def volume_names(self) -> set[str]:
        with self._lock, self.host.translate("listing volumes"):
            return set(self.ensure_pool(refresh=True).listVolumes())

    def _upload(self, pool: libvirt.virStoragePool, name: str, source: Path, fmt: str) -> libvirt.virStorageVol:
        size = source.stat().st_size
        vol = pool.createXML(VolumeSpec(name, size, format=fmt).to_xml(), 0)  # type: ignore[arg-type]
        stream = self.host.conn.newStream(0)
        try:
            vol.upload(stream, 0, size, 0)
            with source.open("rb") as fh:
                stream.sendAll(lambda _s, nbytes, f: f.read(nbytes), fh)
            stream.finish()
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                stream.abort()
            with contextlib.suppress(libvirt.libvirtError):
                vol.delete(0)
            raise
        return vol

    def upload_image(self, tag: str, base: Path, kernel: Path, initrd: Path) -> BaseImage:
        """Upload the guest image (qcow2, kernel, initrd) once per image version.

        Volume names carry the image's tag, so a rebuilt image is uploaded beside the old one and
        existing guests keep their backing file.
        """
        wanted = {
            f"pgcarve-base-{tag}.qcow2": (base, "qcow2"),
            f"pgcarve-vmlinuz-{tag}": (kernel, "raw"),
            f"pgcarve-initrd-{tag}": (initrd, "raw"),
        }
        with self._lock, self.host.acting("uploading the guest image"):
            pool = self.ensure_pool(refresh=True)
            present = set(pool.listVolumes())
            for name, (source, fmt) in wanted.items():
                if name not in present:
                    self._upload(pool, name, source, fmt)
            names = list(wanted)
            return BaseImage(
                disk=names[0],
                kernel_path=pool.storageVolLookupByName(names[1]).path(),
                initrd_path=pool.storageVolLookupByName(names[2]).path(),
            )

    def uploaded_image(self, tag: str, prepare: bool = True) -> BaseImage | None:
        """The image version `tag` if its volumes are on this host (a retired guest's disk was
        made from it: control/retirement.py boots it with its own kernel again). prepare=False
        only looks: a pool that is not defined or not running means no image, and stays so."""
        names = (f"pgcarve-base-{tag}.qcow2", f"pgcarve-vmlinuz-{tag}", f"pgcarve-initrd-{tag}")
        with self._lock, self.host.translate(f"looking up guest image {tag}"):
            pool = self.ensure_pool(refresh=True) if prepare else self._running_pool()
            if pool is None or not set(names) <= set(pool.listVolumes()):
                return None
            return BaseImage(disk=names[0], kernel_path=pool.storageVolLookupByName(names[1]).path(),
                             initrd_path=pool.storageVolLookupByName(names[2]).path())

    def create_overlay(self, name: str, base_volume: str, size_gib: int) -> None:
        """A qcow2 overlay on the base volume: O(1) in the size of the image."""
        with self._lock, self.host.acting(f"creating disk {name}"):
            pool = self.ensure_pool()
            base = pool.storageVolLookupByName(base_volume)
            spec = VolumeSpec(name, size_gib, unit="GiB", format="qcow2", backing_path=base.path())
            pool.createXML(spec.to_xml(), 0)

    def upload_file(self, name: str, source: Path) -> None:
        with self._lock, self.host.acting(f"uploading {name}"):
            pool = self.ensure_pool()
            with contextlib.suppress(libvirt.libvirtError):
                pool.storageVolLookupByName(name).delete(0)
            self._upload(pool, name, source, "raw")

    def create_marker(self, name: str) -> None:
        """An empty volume whose name records a fact beside the disks it is about (retired guests:
        control/retirement.py); a no-op if it exists."""
        with self._lock, self.host.acting(f"creating marker volume {name}"):
            pool = self.ensure_pool(refresh=True)
            if name not in pool.listVolumes():
                pool.createXML(VolumeSpec(name, 0, format="raw").to_xml(), 0)

    def allocations_mib(self, names: Iterable[str]) -> dict[str, int]:
        """The space these volumes take on disk now (MiB, rounded up); absent ones are left out."""
        with self._lock, self.host.translate("reading volume sizes"):
            pool = self.ensure_pool()
            sizes = {}
            for name in names:
                with contextlib.suppress(libvirt.libvirtError):  # not there (any more)
                    sizes[name] = -(-int(pool.storageVolLookupByName(name).info()[2]) // (1024 * 1024))
            return sizes

    def delete_volume(self, name: str) -> bool:
        """Delete a volume if it exists; True if something was deleted."""
        with self._lock, self.host.acting(f"deleting volume {name}"):
            pool = self.ensure_pool()
            try:
                vol = pool.storageVolLookupByName(name)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_STORAGE_VOL:
                    return False
                raise
            vol.delete(0)
            return True

    def pool_free_mib(self) -> int:
        """Free space in pgcarve's storage pool, as the pool's filesystem reports it now."""
        with self._lock, self.host.translate(f"reading free space of pool {self.pool_name}"):
            pool = self.ensure_pool(refresh=True)
            return int(pool.info()[3] // (1024 * 1024))
