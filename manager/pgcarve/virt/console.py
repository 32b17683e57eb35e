"""A booting guest's serial console, read through libvirt while the manager waits for it.

The console log file libvirt writes sits on the guest's host, which the manager may reach only
through libvirt; a console stream reaches it over any libvirt URI. The stream is opened right
after the domain starts (the kernel runs `quiet`, so nothing of note is printed before) and read
without blocking, between the checks of the wait that owns it. What was read is kept, bounded,
so a stuck boot can be told in the console's own words and saved for the operator.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import libvirt

from pgcarve.virt.host import LibvirtHost

log = logging.getLogger(__name__)
KEEP_BYTES = 256 * 1024  # of a boot's console; the start and the newest part are what tell
# Terminal control sequences getty and the kernel emit: noise in an operator's message.
_CONTROL = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b\[[0-9;?!]*[A-Za-z]|\x1b[()][AB0-2]"
                      r"|[\x00-\x08\x0b-\x1f\x7f]")


def readable(console: str) -> str:
    """A console's text without terminal control sequences, one line per line."""
    return _CONTROL.sub("", console.replace("\r\n", "\n").replace("\r", "\n"))


class ConsoleTap:
    """The console of guest `name` on `host`, from the moment it is opened."""

    def __init__(self, host: LibvirtHost, name: str) -> None:
        self.name = name
        self._data = bytearray()
        self._stream: libvirt.virStream | None = None
        try:
            stream = host.conn.newStream(libvirt.VIR_STREAM_NONBLOCK)
            host.conn.lookupByName(name).openConsole(None, stream, libvirt.VIR_DOMAIN_CONSOLE_FORCE)
            self._stream = stream
        except libvirt.libvirtError as exc:  # the boot is still watched by its other stages
            log.info("%s: its console cannot be read (%s); its boot is watched without it", name,
                     exc.get_error_message())

    @property
    def readable(self) -> bool:
        return self._stream is not None

    def drain(self) -> None:
        """Take in what the console printed since the last call, without waiting."""
        while self._stream is not None:
            try:
                chunk = self._stream.recv(65536)
            except libvirt.libvirtError:  # the domain stopped, or another reader took the console
                self.close()
                return
            if chunk == -2 or not isinstance(chunk, bytes):  # nothing more for now
                return
            if not chunk:  # the console closed
                self.close()
                return
            self._data += chunk
            if len(self._data) > KEEP_BYTES:
                del self._data[: len(self._data) - KEEP_BYTES]

    def text(self) -> str:
        """Everything kept, as lines an operator can read (control sequences removed)."""
        return readable(self._data.decode(errors="replace"))

    def tail(self, lines: int = 8) -> list[str]:
        """The last non-empty console lines."""
        return [line.rstrip() for line in self.text().splitlines() if line.strip()][-lines:]

    def save(self, path: Path) -> Path:
        """Write what was kept to `path` (for the operator: the operation's error names it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text())
        return path

    def close(self) -> None:
        if self._stream is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._stream.abort()
            self._stream = None
