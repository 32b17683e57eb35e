"""Which domain type a host's guests get: kvm where a guest really boots under KVM, else qemu."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path

from pgcarve.config import FleetConfig
from pgcarve.guest.image import HostImages
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.probe import probe_kvm


class DomainTypes:
    """`domain_type:` from the hosts file, or (auto) the probe's answer, cached per host URI in
    the state directory so a host is probed once, not per guest or per manager start."""

    def __init__(self, config: FleetConfig, hosts: Mapping[str, LibvirtHost], images: HostImages, cache_file: Path):
        self.config = config
        self.hosts = hosts
        self.images = images
        self.cache_file = cache_file
        self._lock = threading.Lock()  # parallel creations on one host probe it once

    def of(self, host: str) -> str:
        """kvm or qemu for guests on `host`."""
        if self.config.domain_type != "auto":
            return self.config.domain_type
        with self._lock:
            cache = json.loads(self.cache_file.read_text()) if self.cache_file.exists() else {}
            uri = self.config.host(host).uri
            if uri not in cache:
                ok, why = probe_kvm(self.hosts[host], self.images.on(host))
                cache[uri] = {"domain_type": "kvm" if ok else "qemu", "why": why}
                self.cache_file.parent.mkdir(parents=True, exist_ok=True)
                self.cache_file.write_text(json.dumps(cache, indent=2))
            return str(cache[uri]["domain_type"])

    def cached(self, host: str) -> tuple[str, str] | None:
        """The probe's earlier answer for `host` (domain type, why), if it has one: only read,
        never probed (pgcarve doctor reports it)."""
        with self._lock:
            cache = json.loads(self.cache_file.read_text()) if self.cache_file.exists() else {}
        found = cache.get(self.config.host(host).uri)
        return (str(found["domain_type"]), str(found.get("why", ""))) if found else None
