"""The sandbox's reaper: daemons started through it are collected the moment they die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pgcarve.sandbox.reaper
from pgcarve.processes import ProcessStatus, check, read_record

REAPER = Path(pgcarve.sandbox.reaper.__file__)


def gone(pid: int) -> bool:
    """True once the process has been collected (a zombie still has a /proc entry)."""
    return not Path(f"/proc/{pid}").exists()


def test_detached_process_is_adopted_and_collected_at_once(tmp_path: Path) -> None:
    pid_file, child_file = tmp_path / "reaper.json", tmp_path / "child.pid"
    proc = subprocess.run(
        [sys.executable, str(REAPER), str(pid_file),
         "sh", "-c", 'sleep 60 >/dev/null 2>&1 & echo $! > "$1"; echo started >&2; exit 3', "sh", str(child_file)],
        capture_output=True, text=True, timeout=30, check=False)
    # The caller sees the command's own outcome, not the reaper's.
    assert proc.returncode == 3 and proc.stderr == "started\n"
    record, child = read_record(pid_file)[0], int(child_file.read_text())
    assert record is not None and check(record) is ProcessStatus.RUNNING  # recorded with its start time
    reaper_pid = record.pid
    status = Path(f"/proc/{child}/status").read_text()
    assert f"PPid:\t{reaper_pid}\n" in status  # adopted by the reaper, not by PID 1
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not (gone(child) and gone(reaper_pid)):
        assert time.monotonic() < deadline, "the orphan or the reaper lingered"
        time.sleep(0.005)
    assert not pid_file.exists()  # the reaper left with its last child and took its PID file


def test_a_command_that_cannot_run_is_reported(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REAPER), str(tmp_path / "r.json"), str(tmp_path / "no-such-command")],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 1 and "no-such-command" in proc.stderr
