"""Local TCP forwards into sandbox network namespaces.

In the sandbox, guests live in a network namespace that the machine running pgcarve cannot
route to. A forward is a small process that listens on 127.0.0.1 in the caller's namespace and
opens each outgoing connection from inside the sandbox namespace: it binds its listening socket
first, then joins the namespace with setns(2), so later sockets are created in there.

    python -m pgcarve.sandbox.forward --netns /run/netns/NS --target 10.77.0.12:5432 --state FILE.json

Each forward records {pid, start_time, boot_id, port, target, netns} in its state file; pgcarve
signals it only while that PID still names that process (see pgcarve.processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import SandboxError
from pgcarve.processes import (
    ProcessRecord,
    ProcessStatus,
    check,
    read_record,
    record_self,
    stale_reason,
    stop,
    write_record,
)

CLONE_NEWNET = 0x40000000
FORWARD_START_TIMEOUT_S = 30.0
log = logging.getLogger("pgcarve.sandbox")


def join_netns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listener: socket.socket, target_host: str, target_port: int) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(target_host, target_port), 10)
        except (OSError, TimeoutError):
            client_w.close()
            return
        for sock_writer in (client_w, up_w):
            sock = sock_writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream = up_w.get_extra_info("socket")
        if upstream is not None:
            # A guest that dies sends no RST: notice within ~15 s and close the client's side,
            # so a client waiting on a dead primary gets an error instead of hanging for minutes.
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 15000)
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))

    server = await asyncio.start_server(handle, sock=listener)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="forward 127.0.0.1:PORT into a network namespace")
    parser.add_argument("--netns", required=True)
    parser.add_argument("--target", required=True, help="HOST:PORT inside the namespace")
    parser.add_argument("--state", required=True, help="JSON file to record pid and port in")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(128)
    listener.setblocking(False)
    join_netns(args.netns)  # the listener stays in the namespace it was created in
    write_record(Path(args.state), record_self(), port=listener.getsockname()[1], target=args.target,
                 netns=args.netns)
    asyncio.run(_serve(listener, host, int(port)))
    return 0


@dataclass(frozen=True)
class Forward:
    process: ProcessRecord
    port: int
    target: str
    netns: str

    @property
    def pid(self) -> int:
        return self.process.pid


def _load(state: Path) -> Forward | None:
    """The forward a state file describes, if the file holds a complete, verifiable record."""
    record, doc = read_record(state)
    if record is None:
        return None
    try:
        return Forward(record, int(doc["port"]), str(doc["target"]), str(doc["netns"]))
    except (KeyError, TypeError, ValueError):
        return None


class ForwardRegistry:
    """The forwards of one sandbox, one state file per guest."""

    def __init__(self, directory: Path):
        self.directory = directory

    def _file(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    def get(self, name: str) -> Forward | None:
        """The guest's forward if it runs: a state file whose PID has exited, was reused or is
        from before a reboot names no forward (and that PID is never signalled)."""
        fwd = _load(self._file(name))
        return fwd if fwd is not None and check(fwd.process) is ProcessStatus.RUNNING else None

    def ensure(self, name: str, netns: str, target: str) -> Forward:
        """A running forward 127.0.0.1:PORT -> target for this guest (reused if unchanged)."""
        current = self.get(name)
        if current is not None and current.target == target and current.netns == netns:
            return current
        preferred = current.port if current is not None else 0
        if current is not None:
            stop(current.process)
        self.directory.mkdir(parents=True, exist_ok=True)
        state = self._file(name)
        state.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgcarve.sandbox.forward", "--netns", netns, "--target", target,
             "--state", str(state), "--port", str(preferred)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        # A new Python process entering a namespace: seconds on a host busy booting guests.
        deadline = time.monotonic() + FORWARD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            started = _load(state)
            if started is not None and started.pid == proc.pid:
                return started
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                if preferred:  # the old port was taken meanwhile: take any
                    return self.ensure_fresh(name, netns, target)
                raise SandboxError(f"forward for {name} to {target} failed to start: {err.strip()[-300:]}")
            time.sleep(0.02)
        raise SandboxError(f"forward for {name} to {target} did not start in {FORWARD_START_TIMEOUT_S:.0f} s")

    def ensure_fresh(self, name: str, netns: str, target: str) -> Forward:
        self._file(name).unlink(missing_ok=True)
        return self.ensure(name, netns, target)

    def remove(self, name: str) -> None:
        """Stop the guest's forward and forget it; a stale state file is only deleted."""
        recorded = _load(self._file(name))
        if recorded is not None:
            status = stop(recorded.process)
            if status.stale:
                log.info("forward for %s: not signalled, %s", name, stale_reason(recorded.process, status))
        self._file(name).unlink(missing_ok=True)

    def remove_all(self) -> None:
        if not self.directory.exists():
            return
        for state in self.directory.glob("*.json"):
            self.remove(state.stem)


if __name__ == "__main__":
    sys.exit(main())
