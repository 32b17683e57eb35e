"""Local TCP forwards into sandbox network namespaces.

In the sandbox, guests live in a network namespace that the machine running pgcarve cannot
route to. A forward is a small process that listens on 127.0.0.1 in the caller's namespace and
opens each outgoing connection from inside the sandbox namespace: it binds its listening socket
first, then joins the namespace with setns(2), so later sockets are created in there.

    python -m pgcarve.sandbox.forward --netns /run/netns/NS --target 10.77.0.12:5432 --state FILE.json

Each forward records {pid, start_time, boot_id, port, target, netns} in its state file; pgcarve
signals it only while that PID still names that process (see pgcarve.processes).

Two promises make an instance's multi-host URI (control/endpoints.py) last its whole life:

* a guest name keeps its port (`ports.json`, assigned once): a guest restarted, rebuilt or
  failed over is reached at the same 127.0.0.1:PORT;
* a forward whose target does not answer refuses connections (its socket stops listening but
  keeps the port) until the target answers again, so libpq moves on to the next host at once.
  libpq 15 gives up the whole host list when a host accepts the TCP connection and then closes
  it, which is what a forward to a dead guest would otherwise do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import glob
import json
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
from pgcarve.filelock import locked
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
PORTS_FILE = "ports.json"
EXIT_PORT_TAKEN = 3  # the forward's port is held by another program
PROBE_OPEN_S = 3.0  # while accepting: how often the target is checked
PROBE_CLOSED_S = 1.0  # while refusing: how often the target is tried again
CONNECT_TIMEOUT_S = 5.0
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


async def _answers(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Does the target accept a TCP connection now? (Closed at once: PostgreSQL logs nothing
    for a connection that sends no startup packet.)"""
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


async def _relay(client: socket.socket, host: str, port: int, target_down: asyncio.Event) -> None:
    """Join one accepted client to a new connection to the target; a target that does not
    answer closes the client and marks the target down (the forward then refuses)."""
    try:
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError):
        client.close()
        target_down.set()
        return
    try:
        client_r, client_w = await asyncio.open_connection(sock=client)
    except OSError:  # the client left already
        client.close()
        up_w.close()
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


async def _accept(listener: socket.socket, host: str, port: int, target_down: asyncio.Event,
                  relays: set[asyncio.Task[None]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        client, _peer = await loop.sock_accept(listener)
        task = asyncio.create_task(_relay(client, host, port, target_down))
        relays.add(task)
        task.add_done_callback(relays.discard)


async def _watch(host: str, port: int, target_down: asyncio.Event) -> None:
    while not target_down.is_set():
        await asyncio.sleep(PROBE_OPEN_S)
        if not await _answers(host, port):
            target_down.set()


async def _until(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


async def _serve(listener: socket.socket, host: str, port: int) -> None:
    """Accept while the target answers; while it does not, refuse (stop listening, keep the
    port) and try it again every PROBE_CLOSED_S."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    relays: set[asyncio.Task[None]] = set()
    while not stopping.is_set():
        target_down = asyncio.Event()
        workers = [asyncio.create_task(_accept(listener, host, port, target_down, relays)),
                   asyncio.create_task(_watch(host, port, target_down))]
        waits = [asyncio.create_task(stopping.wait()), asyncio.create_task(target_down.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in workers + waits:
            task.cancel()
        await asyncio.gather(*workers, *waits, return_exceptions=True)
        if stopping.is_set():
            break
        # A listening socket shut for reading stops listening but stays bound: connections are
        # refused (RST) until listen() is called again, and no other program can take the port.
        listener.shutdown(socket.SHUT_RD)
        while not stopping.is_set() and not await _answers(host, port):
            await _until(stopping, PROBE_CLOSED_S)
        if not stopping.is_set():
            listener.listen(128)
    for task in list(relays):
        task.cancel()


def bind_listener(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:`port`, bound to that port by number (a socket bound to
    port 0 would lose its port when it stops listening); port 0 picks a free one first."""
    if port == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
    except OSError:
        listener.close()
        raise
    listener.listen(128)
    listener.setblocking(False)
    return listener


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="forward 127.0.0.1:PORT into a network namespace")
    parser.add_argument("--netns", required=True)
    parser.add_argument("--target", required=True, help="HOST:PORT inside the namespace")
    parser.add_argument("--state", required=True, help="JSON file to record pid and port in")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    try:
        listener = bind_listener(args.port)
    except OSError as exc:
        print(f"cannot listen on 127.0.0.1:{args.port}: {exc}", file=sys.stderr)
        return EXIT_PORT_TAKEN if exc.errno == errno.EADDRINUSE else 1
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
    """The forwards of one sandbox: one state file per guest, and each guest name's port."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._ports: dict[str, int] = {}
        self._ports_seen: int | None = None  # st_mtime_ns of the ports file last read

    def _file(self, name: str) -> Path:
        return self.directory / f"{name}.json"

    # -- ports, one per guest name for the sandbox's life ---------------------------------------

    @property
    def _ports_file(self) -> Path:
        return self.directory / PORTS_FILE

    def _ports_locked(self) -> contextlib.AbstractContextManager[None]:
        """Held while a port is assigned, so two processes never give one name two ports."""
        return locked(self.directory / ".ports.lock", directory_mode=0o755)

    def ports(self) -> dict[str, int]:
        """Every guest name's assigned port (re-read only when the file changed)."""
        try:
            seen = self._ports_file.stat().st_mtime_ns
        except FileNotFoundError:
            self._ports, self._ports_seen = {}, None
            return {}
        if seen != self._ports_seen:
            try:
                doc = json.loads(self._ports_file.read_text())
                self._ports = {str(k): int(v) for k, v in doc.items()} if isinstance(doc, dict) else {}
            except (json.JSONDecodeError, ValueError, TypeError):
                self._ports = {}
            self._ports_seen = seen
        return dict(self._ports)

    def _assign(self, name: str, avoid: int | None = None) -> int:
        """Give `name` a port that is free now (another one than `avoid`) and record it."""
        with self._ports_locked():
            ports = self.ports()
            if name in ports and ports[name] != avoid:
                return ports[name]
            taken = set(ports.values())
            while True:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("127.0.0.1", 0))
                    port = int(probe.getsockname()[1])
                if port not in taken and port != avoid:
                    break
            ports[name] = port
            tmp = self._ports_file.with_name(f".{PORTS_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(ports, indent=1, sort_keys=True))
            tmp.replace(self._ports_file)
            return port

    def port(self, name: str) -> int:
        """The loopback port of guest `name`'s forward: assigned once, kept while the sandbox
        lives (whether or not a forward runs: then nothing listens, and a client moves on)."""
        return self.ports().get(name) or self._assign(name)

    # -- forwards ----------------------------------------------------------------------------

    def get(self, name: str) -> Forward | None:
        """The guest's forward if it runs: a state file whose PID has exited, was reused or is
        from before a reboot names no forward (and that PID is never signalled)."""
        fwd = _load(self._file(name))
        return fwd if fwd is not None and check(fwd.process) is ProcessStatus.RUNNING else None

    def ensure(self, name: str, netns: str, target: str) -> Forward:
        """A running forward 127.0.0.1:PORT -> target for this guest, on the name's own port
        (reused if unchanged). One process at a time per name: the API server and a CLI (or a
        test) reaching the same guest would otherwise both start one, and the loser would take
        the port for "taken by another program" and move the name."""
        with locked(self.directory / f".{name}.lock", directory_mode=0o755):
            return self._ensure(name, netns, target)

    def _ensure(self, name: str, netns: str, target: str) -> Forward:
        port = self.port(name)
        started = self._replace(name, netns, target, port)
        if started is None:
            # Another program took the port while no forward held it: the name gets a new one.
            fresh = self._assign(name, avoid=port)
            log.warning("forward for %s: port %d is taken by another program; moving to port %d", name, port, fresh)
            started = self._start(name, netns, target, fresh)
            if started is None:
                raise SandboxError(f"forward for {name}: ports {port} and {fresh} are both taken")
        return started

    def _replace(self, name: str, netns: str, target: str, port: int) -> Forward | None:
        """The name's forward to exactly this target and port: the running one if it is that,
        else a new one in its place; None if another program holds the port."""
        current = self.get(name)
        if current is not None and (current.target, current.netns, current.port) == (target, netns, port):
            return current
        if current is not None:
            stop(current.process)
        return self._start(name, netns, target, port)

    def _start(self, name: str, netns: str, target: str, port: int) -> Forward | None:
        """Start a forward on `port`; None if that port is taken."""
        self.directory.mkdir(parents=True, exist_ok=True)
        state = self._file(name)
        state.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgcarve.sandbox.forward", "--netns", netns, "--target", target,
             "--state", str(state), "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        # A new Python process entering a namespace: seconds on a host busy booting guests.
        deadline = time.monotonic() + FORWARD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            started = _load(state)
            if started is not None and started.pid == proc.pid:
                return started
            code = proc.poll()
            if code is not None:
                if code == EXIT_PORT_TAKEN:
                    return None
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise SandboxError(f"forward for {name} to {target} failed to start: {err.strip()[-300:]}")
            time.sleep(0.02)
        raise SandboxError(f"forward for {name} to {target} did not start in {FORWARD_START_TIMEOUT_S:.0f} s")

    def publish(self, name: str, netns: str, target: str, port: int) -> Forward:
        """A running forward 127.0.0.1:`port` -> target, on exactly that port (a service such as
        the API, whose address someone was told); SandboxError if another program holds it."""
        with locked(self.directory / f".{name}.lock", directory_mode=0o755):
            started = self._replace(name, netns, target, port)
            if started is None:
                raise SandboxError(f"127.0.0.1:{port} is taken by another program; choose another port with --port")
            return started

    def remove(self, name: str) -> None:
        """Stop the guest's forward and its forwards to further ports ("NAME.pPORT", see
        Fleet.endpoint_at); a stale state file is only deleted. The names keep their ports."""
        extra = sorted(p.name[:-len(".json")] for p in self.directory.glob(f"{glob.escape(name)}.p*.json")
                       ) if self.directory.exists() else []
        for key in (name, *extra):
            recorded = _load(self._file(key))
            if recorded is not None:
                status = stop(recorded.process)
                if status.stale:
                    log.info("forward for %s: not signalled, %s", key, stale_reason(recorded.process, status))
            self._file(key).unlink(missing_ok=True)

    def remove_all(self) -> None:
        """Stop every forward and forget every port (the sandbox goes)."""
        if not self.directory.exists():
            return
        for state in sorted(self.directory.glob("*.json")):
            if state.name != PORTS_FILE:
                self.remove(state.stem)
        self._ports_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
