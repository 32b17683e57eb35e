"""PID records (pgcarve.processes): a signal reaches the recorded process, and never a PID that
has exited, was reused by another process or was recorded before the last boot. Also the users of
records: the sandbox's forwards, daemons and reapers."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pgcarve import processes
from pgcarve.processes import ProcessRecord, ProcessStatus
from pgcarve.sandbox import hosts as sandbox_hosts
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.sandbox.hosts import Sandbox


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; whatever is left is stopped by PID afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def spawn(children: list[subprocess.Popen[bytes]], *argv: str, shows_as: str | None = None) -> subprocess.Popen[bytes]:
    """Start argv; return once its command line is argv[0] (or `shows_as`), i.e. it has exec'd."""
    proc = subprocess.Popen(list(argv))
    children.append(proc)
    deadline = time.monotonic() + 5
    while processes.cmdline(proc.pid)[:1] != (shows_as or argv[0],):
        assert time.monotonic() < deadline, f"{argv} did not start"
        time.sleep(0.01)
    return proc


def gone(pid: int) -> bool:
    """The process has exited and was collected (stop() collects its caller's children)."""
    return not Path(f"/proc/{pid}").exists()


def test_a_record_names_its_process(children: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn(children, "sleep", "60")
    record = processes.record_process(proc.pid)
    assert record.pid == proc.pid and record.cmdline == ("sleep", "60")
    assert record.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert processes.check(record) is ProcessStatus.RUNNING
    assert ProcessRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert processes.stop(record) is ProcessStatus.RUNNING
    assert gone(proc.pid)
    assert processes.check(record) is ProcessStatus.EXITED


def test_an_exited_process_is_stale(children: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn(children, "sleep", "60")
    record = processes.record_process(proc.pid)
    proc.kill()
    proc.wait(5)
    assert processes.check(record) is ProcessStatus.EXITED
    assert processes.stop(record) is ProcessStatus.EXITED
    assert "has exited" in processes.stale_reason(record, ProcessStatus.EXITED)


def test_a_zombie_counts_as_exited(children: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn(children, "sleep", "60")
    record = processes.record_process(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while processes.check(record) is ProcessStatus.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert Path(f"/proc/{proc.pid}").exists(), "still a zombie: not collected yet"
    assert processes.check(record) is ProcessStatus.EXITED


def test_a_pid_now_owned_by_another_process_is_never_signalled(children: list[subprocess.Popen[bytes]]) -> None:
    """A record whose PID now names a different live process (here: a PID file left by one
    process, holding the PID of another started later with another command line) is reported
    as stale, naming the process that has the PID now, and that process is not signalled."""
    first = spawn(children, "sleep", "60")
    left_behind = processes.record_process(first.pid)
    first.kill()
    first.wait(5)
    # Start times count clock ticks (10 ms): a real reuse comes after the PID space wrapped,
    # long after; two processes started within one tick would look alike.
    time.sleep(0.05)
    other = spawn(children, sys.executable, "-c", "import time; time.sleep(60)")
    stale = dataclasses.replace(left_behind, pid=other.pid)
    assert processes.check(stale) is ProcessStatus.REUSED
    assert processes.stop(stale, timeout_s=0.5) is ProcessStatus.REUSED
    assert processes.signal_process(stale, signal.SIGKILL) is ProcessStatus.REUSED
    time.sleep(0.2)
    assert other.poll() is None, "the other process was signalled"
    reason = processes.stale_reason(stale, ProcessStatus.REUSED)
    assert "another process" in reason and "time.sleep(60)" in reason


def test_a_record_from_before_a_reboot_is_never_signalled(children: list[subprocess.Popen[bytes]]) -> None:
    """Same PID and start time, another boot: after a reboot any process may hold that PID."""
    proc = spawn(children, "sleep", "60")
    before_reboot = dataclasses.replace(processes.record_process(proc.pid), boot_id="00000000-old-boot")
    assert processes.check(before_reboot) is ProcessStatus.OTHER_BOOT
    assert processes.stop(before_reboot, timeout_s=0.5) is ProcessStatus.OTHER_BOOT
    time.sleep(0.2)
    assert proc.poll() is None
    assert "before the machine last booted" in processes.stale_reason(before_reboot, ProcessStatus.OTHER_BOOT)


@pytest.mark.parametrize("doc", [
    {"pid": 1234},  # a PID file from before records were kept
    {"pid": 1234, "start_time": "12", "boot_id": "x"},
    {"pid": -1, "start_time": 12, "boot_id": "x"},
    {"pid": 1234, "start_time": 12},
    ["pid", 1234],
])
def test_records_that_cannot_be_verified_name_nothing(tmp_path: Path, doc: object) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps(doc))
    assert processes.read_record(path)[0] is None
    assert processes.running_record(path) is None


def ignores_sigterm(pid: int, timeout_s: float = 30) -> None:
    """Until process `pid` ignores SIGTERM (SigIgn in /proc/<pid>/status), i.e. its handler is in."""
    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + timeout_s
    while True:
        status = Path(f"/proc/{pid}/status").read_text()
        ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
        if ignored & bit:
            return
        assert time.monotonic() < deadline, f"process {pid} did not start ignoring SIGTERM within {timeout_s} s"
        time.sleep(0.02)


def test_stop_escalates_to_sigkill(children: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn(children, sys.executable, "-c",
                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)")
    ignores_sigterm(proc.pid)
    record = processes.record_process(proc.pid)
    started = time.monotonic()
    assert processes.stop(record, timeout_s=0.5) is ProcessStatus.RUNNING
    assert gone(proc.pid) and time.monotonic() - started >= 0.5, "outlived SIGTERM, ended by SIGKILL"


def test_without_pidfd_the_check_still_guards(children: list[subprocess.Popen[bytes]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """On kernels without pidfd_open the same checks decide (signals then go by PID)."""
    def no_pidfd(_pid: int) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")

    monkeypatch.setattr(processes.os, "pidfd_open", no_pidfd)
    proc = spawn(children, "sleep", "60")
    record = processes.record_process(proc.pid)
    assert processes.stop(dataclasses.replace(record, start_time=record.start_time - 1)) is ProcessStatus.REUSED
    assert proc.poll() is None
    assert processes.stop(record) is ProcessStatus.RUNNING
    assert gone(proc.pid)


def test_stop_pid_stops_a_child(children: list[subprocess.Popen[bytes]]) -> None:
    proc = spawn(children, "sleep", "60")
    processes.stop_pid(proc.pid, timeout_s=5)
    assert gone(proc.pid)
    processes.stop_pid(proc.pid)  # gone: nothing happens


# --- the sandbox's records ------------------------------------------------------------------------

def test_a_stale_forward_is_not_signalled(tmp_path: Path, children: list[subprocess.Popen[bytes]]) -> None:
    """A forward's state file whose PID now names another process: the forward is reported as
    not running, and removing it deletes the file without signalling that process."""
    registry = ForwardRegistry(tmp_path / "forwards")
    proc = spawn(children, "sleep", "60")
    record = dataclasses.replace(processes.record_process(proc.pid), start_time=1)
    processes.write_record(tmp_path / "forwards" / "pgc-01.json", record, port=40000, target="10.77.0.12:5432",
                           netns="/run/netns/x")
    assert registry.get("pgc-01") is None
    registry.remove_all()
    assert not (tmp_path / "forwards" / "pgc-01.json").exists()
    time.sleep(0.2)
    assert proc.poll() is None


def test_a_forward_from_an_older_pgcarve_is_not_signalled(tmp_path: Path,
                                                          children: list[subprocess.Popen[bytes]]) -> None:
    """{pid, port, target, netns} without a start time cannot be verified: never signalled."""
    proc = spawn(children, "sleep", "60")
    (tmp_path / "forwards").mkdir()
    (tmp_path / "forwards" / "pgc-01.json").write_text(json.dumps(
        {"pid": proc.pid, "port": 40000, "target": "10.77.0.12:5432", "netns": "/run/netns/x"}))
    registry = ForwardRegistry(tmp_path / "forwards")
    assert registry.get("pgc-01") is None
    registry.remove("pgc-01")
    time.sleep(0.2)
    assert proc.poll() is None


def test_removing_a_guests_forward_removes_its_forwards_to_further_ports(tmp_path: Path) -> None:
    """Fleet.endpoint_at keeps one forward per further cluster ("NAME.pPORT"); they go with the guest,
    and a guest whose name only starts with the same letters keeps its own."""
    directory = tmp_path / "forwards"
    directory.mkdir()
    names = ("pgc-01", "pgc-01.p5433", "pgc-01.p5434", "pgc-01-s1", "pgc-01-s1.p5433")
    for name in names:  # records without a start time: never signalled
        (directory / f"{name}.json").write_text(json.dumps(
            {"pid": 1, "port": 40000, "target": "10.77.0.12:5432", "netns": "/run/netns/x"}))
    ForwardRegistry(directory).remove("pgc-01")
    assert sorted(p.stem for p in directory.iterdir()) == ["pgc-01-s1", "pgc-01-s1.p5433"]


def _fake_netns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sandbox: Sandbox) -> None:
    """Pretend host 0's network namespace is this test's own (a link to /proc/self/ns/net)."""
    netns_dir = tmp_path / "netns"
    netns_dir.mkdir()
    (netns_dir / sandbox.host(0).netns).symlink_to(f"/proc/{os.getpid()}/ns/net")
    monkeypatch.setattr(sandbox_hosts, "NETNS_DIR", netns_dir)


def test_sandbox_daemons_are_recognised_by_name_and_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, children: list[subprocess.Popen[bytes]],
) -> None:
    """A daemon's own pid file is adopted (recorded with its start time) only if that PID is
    the daemon, inside the host's network namespace; then the record decides."""
    sandbox = Sandbox(tmp_path / "sandbox")
    host = sandbox.host(0)
    (host.directory / "pids").mkdir(parents=True)
    pid_file = host.directory / "pids" / "virtlogd.pid"
    record_file = host.directory / "pids" / "virtlogd.json"

    not_a_daemon = spawn(children, "sleep", "60")
    pid_file.write_text(f"{not_a_daemon.pid}\n")
    assert sandbox.daemon(host, "virtlogd") is None, "a live PID that is not virtlogd"

    _fake_netns(tmp_path, monkeypatch, sandbox)
    # A process whose argv[0] is "virtlogd", in the (fake) host namespace: adopted and recorded.
    daemon = spawn(children, "bash", "-c", "exec -a virtlogd sleep 60", shows_as="virtlogd")
    pid_file.write_text(f"{daemon.pid}\n")
    adopted = sandbox.daemon(host, "virtlogd")
    assert adopted is not None and adopted.pid == daemon.pid
    assert processes.read_record(record_file)[0] == adopted

    # The record from before a reboot: neither it nor the pid file's PID (now another process's
    # as far as the namespace check goes) is trusted.
    processes.write_record(record_file, dataclasses.replace(adopted, boot_id="old-boot"))
    pid_file.write_text(f"{not_a_daemon.pid}\n")
    assert sandbox.daemon(host, "virtlogd") is None
    time.sleep(0.1)
    assert daemon.poll() is None and not_a_daemon.poll() is None


def test_sandbox_namespace_mismatch_is_not_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, children: list[subprocess.Popen[bytes]],
) -> None:
    """Right name, wrong namespace: someone else's libvirtd is never taken for the sandbox's."""
    sandbox = Sandbox(tmp_path / "sandbox")
    host = sandbox.host(0)
    (host.directory / "pids").mkdir(parents=True)
    netns_dir = tmp_path / "netns"
    netns_dir.mkdir()
    (netns_dir / host.netns).write_text("")  # a file that is not this process's namespace
    monkeypatch.setattr(sandbox_hosts, "NETNS_DIR", netns_dir)
    daemon = spawn(children, "bash", "-c", "exec -a libvirtd sleep 60", shows_as="libvirtd")
    (host.directory / "pids" / "libvirtd.pid").write_text(f"{daemon.pid}\n")
    assert sandbox.daemon(host, "libvirtd") is None
    assert not sandbox.is_up()


def test_stale_reaper_records_are_skipped(tmp_path: Path, children: list[subprocess.Popen[bytes]]) -> None:
    sandbox = Sandbox(tmp_path / "sandbox")
    host = sandbox.host(0)
    (host.directory / "pids").mkdir(parents=True)
    live = spawn(children, "sleep", "60")
    record = processes.record_process(live.pid)
    processes.write_record(host.directory / "pids" / "reaper-1.json", record)
    processes.write_record(host.directory / "pids" / "reaper-2.json", dataclasses.replace(record, start_time=1))
    assert sandbox._reapers(host) == [record]


def test_kill_guest_signals_only_a_qemu_in_the_hosts_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, children: list[subprocess.Popen[bytes]],
) -> None:
    """The fault injector reads the QEMU PID from libvirt's pid file and kills it: only if that
    PID is a QEMU inside the sandbox host's network namespace."""
    from pgcarve.errors import SandboxError
    from pgcarve.sandbox.faults import SandboxFaults

    sandbox = Sandbox(tmp_path / "sandbox")
    sandbox.host(0).directory.mkdir(parents=True)
    faults = SandboxFaults(sandbox)
    not_qemu = spawn(children, "sleep", "60")
    monkeypatch.setattr(faults, "qemu_pid", lambda _host, _guest: not_qemu.pid)
    with pytest.raises(SandboxError, match="is not a QEMU"):
        faults.kill_guest("h0", "pgc-01")
    assert not_qemu.poll() is None

    qemu = spawn(children, "bash", "-c", "exec -a qemu-system-x86_64 sleep 60", shows_as="qemu-system-x86_64")
    monkeypatch.setattr(faults, "qemu_pid", lambda _host, _guest: qemu.pid)
    with pytest.raises(SandboxError, match="is not a QEMU"):  # right name, another namespace
        faults.kill_guest("h0", "pgc-01")
    _fake_netns(tmp_path, monkeypatch, sandbox)
    assert faults.kill_guest("h0", "pgc-01") == qemu.pid
    assert qemu.wait(5) == -signal.SIGKILL
