"""Network namespace plumbing shared by the sandbox's hosts, wire and manager namespace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pgcarve.processes as processes
from pgcarve.errors import SandboxError
from pgcarve.processes import ProcessRecord, ProcessStatus

NETNS_DIR = Path("/run/netns")  # where `ip netns add` keeps the namespaces it names


def run_checked(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise SandboxError(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def same_netns(a: Path, b: Path) -> bool:
    """Two nsfs paths name the same network namespace (what `ip netns identify` compares)."""
    first, second = os.stat(a), os.stat(b)
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def stop_namespace_processes(netns: str) -> None:
    """Processes still inside a namespace we created (e.g. qemu or dnsmasq left by a killed
    libvirtd, an sshd session, a manager started there) are ours: stop them by PID before the
    namespace goes."""
    for _ in range(2):
        # Recorded as listed, so the signals below reach these processes or none.
        records = []
        for pid in run_checked(["ip", "netns", "pids", netns], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                records.append(processes.record_process(int(pid)))
        if not records:
            return
        for record in records:
            processes.signal_process(record, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(processes.check(r) is ProcessStatus.RUNNING for r in records):
            time.sleep(0.1)
        for record in records:
            processes.signal_process(record, signal.SIGKILL)


def adopt_daemon(pid_file: Path, program: str, netns_path: Path, record_file: Path) -> ProcessRecord | None:
    """Record the PID in a daemon's own pid file (at `record_file`) if it is `program` running in
    the network namespace at `netns_path`. A pid file from before a reboot fails that (the
    namespace is gone or new; the PID is someone else's), and so does a PID reused by any other
    process."""
    try:
        pid = int(pid_file.read_text().strip())
        record = processes.record_process(pid)
        # sshd retitles itself "sshd: /usr/sbin/sshd -f ...".
        first = record.cmdline[0].split()[0].rstrip(":") if record.cmdline and record.cmdline[0] else ""
        ours = Path(first).name == program and same_netns(Path(f"/proc/{pid}/ns/net"), netns_path)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    # Checked again: the PID could have changed hands while its namespace was looked at.
    if not ours or processes.check(record) is not ProcessStatus.RUNNING:
        return None
    processes.write_record(record_file, record)
    return record
