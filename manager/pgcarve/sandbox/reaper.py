"""Start sandbox daemons under a process that reaps them, and their QEMU guests, at once.

libvirt reports a guest stopped only after its dead QEMU process has vanished, and a daemon's
orphans vanish when whoever adopted them collects them. PID 1 does that on a normal host
(systemd, immediately); in some containers and microVMs PID 1 collects orphans only every second
or two, which delayed every "guest stopped" event, and so every repair, by that much.

`python -m pgcarve.sandbox.reaper RECORDFILE COMMAND...` runs COMMAND (which starts daemons that
detach) from a child subreaper (prctl PR_SET_CHILD_SUBREAPER): the daemons, and every QEMU process
they start later, are re-parented to it and collected the moment they exit. The caller gets
COMMAND's exit status and error output as usual; the reaper stays behind, records itself (PID,
start time, boot: pgcarve.processes) in RECORDFILE, and exits when the last process it adopted has.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pgcarve.processes import record_self, write_record

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _reap_until_alone(record_file: Path) -> None:
    try:
        while True:
            os.wait()  # blocks; EINTR is retried by Python
    except ChildProcessError:  # nothing left to adopt or collect
        pass
    finally:
        record_file.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: python -m pgcarve.sandbox.reaper RECORDFILE COMMAND...\n")
        return 2
    record_file, command = Path(argv[0]), argv[1:]
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        # The caller's side: wait for COMMAND's outcome, not for the reaper.
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            report = pipe.read().decode(errors="replace")
        code, _, errors = report.partition("\n")
        sys.stderr.write(errors)
        return int(code) if code.lstrip("-").isdigit() else 1
    os.close(read_end)
    try:
        os.setsid()  # not in the caller's session: a Ctrl-C there must not reach the daemons
        _become_subreaper()
        write_record(record_file, record_self())
        # A file, not a pipe, for COMMAND's stderr: a daemon that kept the pipe open would
        # make reading it wait forever.
        with tempfile.TemporaryFile() as err:
            status = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, check=False).returncode
            err.seek(0)
            output = err.read()
    except Exception as exc:  # reported to the caller, who shows it
        status, output = 1, f"pgcarve.sandbox.reaper: {exc}\n".encode()
    os.write(write_end, f"{status}\n".encode() + output)
    os.close(write_end)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _reap_until_alone(record_file)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
