"""Processes pgcarve started, recorded so that a signal only ever reaches the process meant.

A PID alone names a process only while that process lives: after it exits the kernel hands the
number to the next process, and after a reboot every PID in a file names something else. So
whenever pgcarve records a process it keeps, beside the PID, the process's start time (clock
ticks after boot, field 22 of /proc/<pid>/stat) and the boot it belongs to (the kernel's
boot_id). Before any signal the record is checked against what /proc says now; a PID that has
exited, was reused, or is from another boot is reported as stale and never signalled.

The check and the signal go through a pidfd (pidfd_open(2), Linux 5.3+): the descriptor is
opened first and names one process for good, so a PID reused between the check and the signal
cannot be hit either.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import select
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
RECORD_KEYS = ("pid", "start_time", "boot_id", "cmdline")


class ProcessStatus(enum.Enum):
    """What a recorded PID names now."""

    RUNNING = "running"  # the recorded process itself, alive
    EXITED = "exited"  # no process has that PID now (or only the recorded one's zombie)
    REUSED = "reused"  # the PID belongs to another process, started after the recorded one
    OTHER_BOOT = "other-boot"  # the record was written before the machine last booted

    @property
    def stale(self) -> bool:
        return self is not ProcessStatus.RUNNING


@dataclass(frozen=True)
class ProcessRecord:
    """One started process: its PID, when it started, in which boot, and what it ran."""

    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    boot_id: str
    cmdline: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id,
                "cmdline": list(self.cmdline)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProcessRecord | None:
        """The record in `data`, or None when it lacks a start time or boot id (a PID file from
        before records were kept, or damaged): such a PID cannot be verified, so it is stale."""
        try:
            pid, start_time, boot_id = data["pid"], data["start_time"], data["boot_id"]
        except (KeyError, TypeError):
            return None
        if not (isinstance(pid, int) and isinstance(start_time, int) and isinstance(boot_id, str)) or pid <= 0:
            return None
        cmdline = data.get("cmdline") or ()
        return cls(pid, start_time, boot_id, tuple(str(a) for a in cmdline) if isinstance(cmdline, list) else ())

    def describe(self) -> str:
        command = " ".join(self.cmdline)
        return f"pid {self.pid}" + (f" ({command[:120]})" if command else "")


def boot_id() -> str:
    return BOOT_ID_FILE.read_text().strip()


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, or None if there is no such process. The
    command name (field 2) may hold spaces and parentheses: split after its last ')'."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot, or None if it does not exist."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of the whole line


def cmdline(pid: int) -> tuple[str, ...]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ()
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def record_process(pid: int) -> ProcessRecord:
    """Record the process that has `pid` now. Call it while the process is known to be the one
    meant (just started, or just checked); raises ProcessLookupError if there is none."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        raise ProcessLookupError(f"no process with pid {pid}")
    return ProcessRecord(pid, int(fields[19]), boot_id(), cmdline(pid))


def record_self() -> ProcessRecord:
    return record_process(os.getpid())


def check(record: ProcessRecord) -> ProcessStatus:
    """Whether `record` still names a live process (a zombie counts as exited)."""
    if record.boot_id != boot_id():
        return ProcessStatus.OTHER_BOOT
    fields = _stat_fields(record.pid)
    if fields is None:
        return ProcessStatus.EXITED
    if int(fields[19]) != record.start_time:
        return ProcessStatus.REUSED
    return ProcessStatus.EXITED if fields[0] in ("Z", "X") else ProcessStatus.RUNNING


def stale_reason(record: ProcessRecord, status: ProcessStatus) -> str:
    """Why `record` is not signalled, in words for an operator."""
    if status is ProcessStatus.OTHER_BOOT:
        return f"{record.describe()} was recorded before the machine last booted"
    if status is ProcessStatus.REUSED:
        now = " ".join(cmdline(record.pid))[:120] or "unknown"
        return f"{record.describe()} has exited and its PID now belongs to another process ({now})"
    return f"{record.describe()} has exited"


@contextlib.contextmanager
def _pidfd(pid: int) -> Iterator[int | None]:
    """A pidfd for `pid`, or None where the kernel has none (then signals go by PID)."""
    try:
        fd = os.pidfd_open(pid)  # ProcessLookupError (an OSError) goes to the caller
    except ProcessLookupError:
        raise
    except OSError:  # ENOSYS on kernels before 5.3, or a seccomp filter
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _send(pid: int, fd: int | None, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)


def _wait_exit(pid: int, fd: int | None, timeout_s: float) -> bool:
    """Wait until the process has exited (collecting it if it is our child); True if it did."""
    deadline = time.monotonic() + timeout_s
    poller = None
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        fields = _stat_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            # It may have exited between the waitpid above and this read: collect it now, so a
            # child of ours is gone from /proc when this returns (not left a zombie under load).
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if poller is not None:
            poller.poll(min(left, 0.2) * 1000)  # readable once the process has exited
        else:
            time.sleep(min(left, 0.05))


def stop(record: ProcessRecord, timeout_s: float = 10.0) -> ProcessStatus:
    """SIGTERM the recorded process, then SIGKILL it if it lingers past `timeout_s`; but only
    if the record still names it. Returns what was found: RUNNING means it was stopped, any
    other status means nothing was signalled (see `stale_reason`)."""
    try:
        with _pidfd(record.pid) as fd:
            # Checked after the pidfd is open: if the check passes, the pidfd names this process.
            status = check(record)
            if status is not ProcessStatus.RUNNING:
                return status
            _send(record.pid, fd, signal.SIGTERM)
            if not _wait_exit(record.pid, fd, timeout_s):
                _send(record.pid, fd, signal.SIGKILL)
                _wait_exit(record.pid, fd, 5.0)
            return ProcessStatus.RUNNING
    except ProcessLookupError:
        return ProcessStatus.EXITED


def signal_process(record: ProcessRecord, sig: int) -> ProcessStatus:
    """Send `sig` to the recorded process if the record still names it (see `stop`)."""
    try:
        with _pidfd(record.pid) as fd:
            status = check(record)
            if status is ProcessStatus.RUNNING:
                _send(record.pid, fd, sig)
            return status
    except ProcessLookupError:
        return ProcessStatus.EXITED


def pid_alive(pid: int) -> bool:
    """A process with this PID exists (whichever it is: use `check` for a recorded one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, the process that has `pid` now. Only for a child of this process
    still held (a subprocess.Popen): its PID cannot be reused before it is collected. A PID read
    from a file goes through a ProcessRecord and `stop`."""
    try:
        record = record_process(pid)
    except ProcessLookupError:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # a zombie child: collect it
        return
    stop(record, timeout_s)


# -- record files ------------------------------------------------------------------------------


def write_record(path: Path, record: ProcessRecord, **fields: Any) -> None:
    """Write `record` (and `fields` beside it) to a JSON file, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**fields, **record.to_dict()}))
    tmp.replace(path)


def read_record(path: Path) -> tuple[ProcessRecord | None, dict[str, Any]]:
    """(record, whole document) from a file written by `write_record`. The record is None when
    the file is missing, unreadable or holds no verifiable record; the document is {} when the
    file is missing or not JSON."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None, {}
    if not isinstance(data, dict):
        return None, {}
    return ProcessRecord.from_dict(data), data


def running_record(path: Path) -> ProcessRecord | None:
    """The record in `path` if it names a live process, else None."""
    record, _ = read_record(path)
    return record if record is not None and check(record) is ProcessStatus.RUNNING else None
