"""Does a guest really boot under KVM on this host? (The domain type is chosen by trying.)"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time

import libvirt

from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.storage import BaseImage
from pgcarve.virt.xml_specs import ProbeDomainSpec


def probe_kvm(host: LibvirtHost, image: BaseImage, timeout_s: float = 15.0) -> tuple[bool, str]:
    """Does a guest really boot under KVM here? Boots the image's kernel in a transient
    type='kvm' domain and watches its serial console for the kernel's banner.

    /dev/kvm alone proves nothing: a paravirtual KVM can refuse -cpu host or hang silently.
    """
    spec = ProbeDomainSpec("pgcarve-kvm-probe-" + hashlib.sha256(os.urandom(8)).hexdigest()[:8],
                           image.kernel_path, image.initrd_path)
    try:
        dom = host.conn.createXML(spec.to_xml(), 0)
    except libvirt.libvirtError as exc:
        return False, f"KVM guest did not start: {exc.get_error_message()}"
    seen = b""
    try:
        stream = host.conn.newStream(libvirt.VIR_STREAM_NONBLOCK)
        dom.openConsole(None, stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and b"Linux version" not in seen:
            try:
                chunk = stream.recv(4096)
            except libvirt.libvirtError:
                break
            if chunk == -2:  # nothing yet
                time.sleep(0.1)
                continue
            if not chunk:
                break
            seen += chunk
        with contextlib.suppress(libvirt.libvirtError):
            stream.abort()
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            dom.destroy()
    if b"Linux version" in seen:
        return True, "a KVM guest printed its kernel banner"
    return False, f"a KVM guest printed no kernel banner in {timeout_s:.0f} s"
