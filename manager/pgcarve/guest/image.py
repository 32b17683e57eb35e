"""The guest image on this machine (built by images/build.sh) and its copies on each host."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import ImageMissing
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.storage import BaseImage


@dataclass(frozen=True)
class LocalImage:
    """The image's files: base.qcow2, vmlinuz, initrd.img, inputs.sha256 (its content hash),
    image.tag (the build's name) and versions.env (what it runs)."""

    directory: Path

    @property
    def base(self) -> Path:
        return self.directory / "base.qcow2"

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    @property
    def tag(self) -> str:
        """12 hex digits naming this build (its inputs and its data directory's identity): names
        its volumes on the hosts, so two volumes of one name on two hosts are the same build."""
        return (self.directory / "image.tag").read_text().strip()

    @property
    def versions_file(self) -> Path:
        return self.directory / "versions.env"

    def versions(self) -> dict[str, str]:
        """What the build installed (versions.env: release, kernel, postgresql_major, postgresql,
        patroni, pgbackrest, ...); empty for an image built before it recorded them."""
        try:
            text = self.versions_file.read_text()
        except FileNotFoundError:
            return {}
        found: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and not key.lstrip().startswith("#"):
                found[key.strip()] = value.strip().strip('"')
        return found

    def check(self) -> LocalImage:
        """Itself, or ImageMissing saying how to build it."""
        if not (self.directory / "inputs.sha256").exists():
            raise ImageMissing(f"no guest image in {self.directory}: build it with `make image` "
                               f"(or images/build.sh {self.directory})")
        if not (self.directory / "image.tag").exists():
            raise ImageMissing(f"the guest image in {self.directory} was built before images had build tags "
                               f"(no image.tag): build it again with `make image`")
        missing = [str(p) for p in (self.base, self.kernel, self.initrd) if not p.exists()]
        if missing:
            raise ImageMissing(f"the guest image in {self.directory} is incomplete: {', '.join(missing)} missing")
        return self


class HostImages:
    """The image uploaded to each host once (per image version), on first need."""

    def __init__(self, hosts: Mapping[str, LibvirtHost], image_dir: Path):
        self.hosts = hosts
        self.image_dir = image_dir
        self._uploaded: dict[str, BaseImage] = {}
        self._locks = {name: threading.Lock() for name in hosts}

    def on(self, host: str) -> BaseImage:
        """The image's volumes on `host`, uploading them first if needed."""
        with self._locks[host]:
            if host not in self._uploaded:
                image = LocalImage(self.image_dir).check()
                self._uploaded[host] = self.hosts[host].storage.upload_image(
                    image.tag, image.base, image.kernel, image.initrd)
            return self._uploaded[host]
