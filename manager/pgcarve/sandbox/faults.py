"""Faults injected into the sandbox on purpose, by an operator trying pgcarve out or by a test:
a guest's QEMU killed, a host's libvirtd restarted under running guests, a command run inside a
host (say, a tiny filesystem for a disk-full test). `pgcarve sandbox kill-guest` and
`restart-libvirtd` call these.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from pgcarve.errors import SandboxError
from pgcarve.processes import stop_pid
from pgcarve.sandbox.hosts import Sandbox, run_checked


class SandboxFaults:
    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    def run_in_host(self, host: str, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside sandbox host `host`'s network and mount namespaces."""
        return run_checked([*self.sandbox.enter(self.sandbox.host_named(host)), *args], check=check)

    def qemu_pid(self, host: str, guest: str) -> int:
        """The PID of a guest's QEMU process (libvirt's pid file in the host's private /run)."""
        sandbox_host = self.sandbox.host_named(host)
        pid_file = Path(f"/proc/{self.sandbox.anchor_pid(sandbox_host)}/root/run/libvirt/qemu/{guest}.pid")
        try:
            return int(pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            raise SandboxError(f"{guest} is not running on sandbox host {host} ({pid_file})") from None

    def kill_guest(self, host: str, guest: str) -> int:
        """kill -9 the guest's QEMU process (the sandbox shares this machine's PID namespace);
        returns the PID killed. To libvirt this is a guest whose QEMU died."""
        pid = self.qemu_pid(host, guest)
        os.kill(pid, signal.SIGKILL)
        return pid

    def restart_libvirtd(self, host: str) -> None:
        """Stop the host's libvirtd (by PID) and start it again; guests keep running."""
        sandbox_host = self.sandbox.host_named(host)
        pid = self.sandbox.daemon_pid(sandbox_host, "libvirtd")
        if pid is not None:
            stop_pid(pid)
        pid_file = sandbox_host.directory / "pids" / "libvirtd.pid"
        pid_file.unlink(missing_ok=True)
        self.sandbox.run_reaped(sandbox_host, [*self.sandbox.enter(sandbox_host), "libvirtd", "-d", "-p",
                                               str(pid_file), "-f", "/etc/libvirt/libvirtd.conf"])
        self.sandbox.wait_libvirtd(sandbox_host).close()
