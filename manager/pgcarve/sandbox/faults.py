"""Faults injected into the sandbox on purpose, by an operator trying pgcarve out or by a test:
a guest's QEMU killed, a host's libvirtd restarted under running guests, a whole host killed
(and brought back), a host cut off from the others (and healed), a command run inside a host
(say, a tiny filesystem for a disk-full test), a guest's DHCP requests left unanswered, a guest's
kernel made to panic. `pgcarve sandbox kill-guest | restart-libvirtd |
kill-host | revive-host | partition | heal` call these.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pgcarve.processes as processes
from pgcarve.errors import GuestCommandFailed, SandboxError
from pgcarve.processes import ProcessStatus
from pgcarve.sandbox.hosts import GUEST_BRIDGE, Sandbox, run_checked
from pgcarve.sandbox.namespaces import same_netns
from pgcarve.virt.agent import run_in_guest
from pgcarve.virt.host import LibvirtHost


def _dhcp_rule(mac: str) -> list[str]:
    return ["INPUT", "-p", "udp", "--dport", "67", "-m", "mac", "--mac-source", mac, "-m", "comment",
            "--comment", "pgcarve fault: no DHCP answer", "-j", "DROP"]


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
        returns the PID killed. To libvirt this is a guest whose QEMU died. The PID is signalled
        only if it is a QEMU inside the host's network namespace."""
        pid = self.qemu_pid(host, guest)
        sandbox_host = self.sandbox.host_named(host)
        try:
            record = processes.record_process(pid)
        except ProcessLookupError:
            raise SandboxError(f"{guest} on sandbox host {host}: its QEMU (pid {pid}) has already exited") from None
        try:
            ours = (bool(record.cmdline) and Path(record.cmdline[0]).name.startswith(("qemu", "kvm"))
                    and same_netns(Path(f"/proc/{pid}/ns/net"), sandbox_host.netns_path))
        except FileNotFoundError:  # the process or the host's namespace is gone
            ours = False
        if not ours:
            raise SandboxError(f"{guest} on sandbox host {host}: pid {pid} from libvirt's pid file is not a QEMU "
                               f"in namespace {sandbox_host.netns} ({' '.join(record.cmdline)[:80]}); not signalled")
        status = processes.signal_process(record, signal.SIGKILL)
        if status is not ProcessStatus.RUNNING:
            raise SandboxError(f"{guest} on sandbox host {host}: {processes.stale_reason(record, status)}")
        return pid

    def restart_libvirtd(self, host: str) -> None:
        """Stop the host's libvirtd (by PID) and start it again; guests keep running."""
        sandbox_host = self.sandbox.host_named(host)
        record = self.sandbox.daemon(sandbox_host, "libvirtd")
        if record is not None:
            processes.stop(record)
        pid_file = sandbox_host.directory / "pids" / "libvirtd.pid"
        pid_file.unlink(missing_ok=True)
        self.sandbox.run_reaped(sandbox_host, [*self.sandbox.enter(sandbox_host), "libvirtd", "-d", "-p",
                                               str(pid_file), "-f", "/etc/libvirt/libvirtd.conf"])
        self.sandbox.wait_libvirtd(sandbox_host).close()
        self.sandbox.record_daemons(sandbox_host, ("libvirtd",))

    def kill_host(self, host: str) -> int:
        """Kill every process of a sandbox host at once (libvirtd, virtlogd, dnsmasq, every QEMU,
        the forwards into it), as a power cut would; its disks and namespace stay, so
        revive_host() can bring it back. Returns how many processes were killed."""
        sandbox_host = self.sandbox.host_named(host)
        records = []
        for pid in run_checked(["ip", "netns", "pids", sandbox_host.netns], check=False).stdout.split():
            try:
                records.append(processes.record_process(int(pid)))
            except ProcessLookupError:
                continue
        for record in records:  # recorded first, so a PID reused meanwhile is never hit
            processes.signal_process(record, signal.SIGKILL)
        # A power cut takes the kernel's state too: the guests' bridge goes, so the host's libvirtd
        # starts its network afresh when the host comes back (else "already in use by interface").
        run_checked(["ip", "-n", sandbox_host.netns, "link", "del", GUEST_BRIDGE], check=False)
        return len(records)

    def revive_host(self, host: str) -> None:
        """Start a killed host's daemons again (its guests stay off: the manager decides what each
        becomes, since a failover may have replaced the primaries that ran there)."""
        self.sandbox.revive(self.sandbox.host_named(host))

    def partition(self, host: str) -> None:
        """Cut the host off from the other hosts (its end of the wire goes down); its guests and
        daemons keep running, and this machine still reaches it through its own sockets."""
        sandbox_host = self.sandbox.host_named(host)
        run_checked(["ip", "-n", self.sandbox.wire_netns, "link", "set", f"w{sandbox_host.index}", "down"])

    def heal(self, host: str) -> None:
        """Join a partitioned host to the others again."""
        sandbox_host = self.sandbox.host_named(host)
        run_checked(["ip", "-n", self.sandbox.wire_netns, "link", "set", f"w{sandbox_host.index}", "up"])

    def partitioned(self, host: str) -> bool:
        sandbox_host = self.sandbox.host_named(host)
        out = run_checked(["ip", "-n", self.sandbox.wire_netns, "-o", "link", "show", f"w{sandbox_host.index}"]).stdout
        return "state DOWN" in out or "<BROADCAST,MULTICAST>" in out

    def drop_dhcp(self, host: str, mac: str) -> None:
        """Leave the DHCP requests of the guest with `mac` on `host` unanswered (its host's DHCP
        server never sees them), until `answer_dhcp`. A guest booting meanwhile gets no address."""
        if self.run_in_host(host, ["iptables", "-w", "-C", *_dhcp_rule(mac)], check=False).returncode != 0:
            self.run_in_host(host, ["iptables", "-w", "-I", *_dhcp_rule(mac)[:1], "1", *_dhcp_rule(mac)[1:]])

    def answer_dhcp(self, host: str, mac: str) -> None:
        """Undo `drop_dhcp` (nothing if it was not in place)."""
        while self.run_in_host(host, ["iptables", "-w", "-C", *_dhcp_rule(mac)], check=False).returncode == 0:
            self.run_in_host(host, ["iptables", "-w", "-D", *_dhcp_rule(mac)])

    def panic_guest(self, host: str, guest: str) -> None:
        """Make the guest's kernel panic (sysrq 'c', through its guest agent), as a kernel bug
        would: it stops where it is, its domain still running, its console saying why."""
        sandbox_host = self.sandbox.host_named(host)
        lv = LibvirtHost(sandbox_host.name, sandbox_host.uri)
        try:
            run_in_guest(lv, guest, ["/bin/sh", "-c", "echo c > /proc/sysrq-trigger"], timeout_s=5)
        except GuestCommandFailed:
            pass  # the agent went down with the kernel before it could answer: that is the point
        finally:
            lv.close()
