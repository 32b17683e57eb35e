"""libvirt's lifecycle events: which guests stopped or paused without pgcarve asking.

One LifecycleWatch per host follows its events on a connection of its own, with keepalive and a
close callback, and reconnects when libvirtd goes away (say, restarted). libvirt-python's event
loop runs on one daemon thread per process (start_event_loop).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import libvirt

_event_loop_lock = threading.Lock()
_event_loop_started = False


def start_event_loop() -> None:
    """Run libvirt's default event loop on a daemon thread (once per process).

    Needed for lifecycle events and for noticing a lost connection (keepalive). Connections
    opened before this call get neither, so a long-running manager calls it first.
    """
    global _event_loop_started
    with _event_loop_lock:
        if _event_loop_started:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _event_loop_started = True


@dataclass(frozen=True)
class GuestEvent:
    """A guest stopped or paused without being asked to, as libvirt reported it."""

    host: str
    name: str
    kind: Literal["stopped", "paused"]
    cause: str  # libvirt's reason in words
    at: float  # time.time() when the event arrived


_STOP_CAUSES = {
    libvirt.VIR_DOMAIN_EVENT_STOPPED_SHUTDOWN: "the guest powered off",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_DESTROYED: "it was destroyed (forced off)",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_CRASHED: "the guest crashed",
    libvirt.VIR_DOMAIN_EVENT_STOPPED_FAILED: "its QEMU process died",
}
_PAUSE_CAUSES = {
    libvirt.VIR_DOMAIN_EVENT_SUSPENDED_IOERROR: "QEMU paused it on a disk I/O error (disk full?)",
    libvirt.VIR_DOMAIN_EVENT_SUSPENDED_WATCHDOG: "QEMU paused it: its watchdog fired",
}


class LifecycleWatch:
    """Follows one host's domain lifecycle events on a connection of its own, reconnecting when
    libvirtd goes away (e.g. restarted). `on_event` gets GuestEvents; `on_connect` is called after
    each (re)connection, when events may have been missed."""

    def __init__(self, name: str, uri: str, on_event: Callable[[GuestEvent], None],
                 on_connect: Callable[[str, bool], None], retry_s: float = 1.0):
        self.name = name
        self.uri = uri
        self.on_event = on_event
        self.on_connect = on_connect
        self.retry_s = retry_s
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lifecycle-{name}", daemon=True)

    def start(self) -> None:
        start_event_loop()
        self._thread.start()

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop following events; with `wait_s`, wait that long for the callback to be deregistered
        and the connection closed (a watch started right after on the same driver then never runs
        beside this one's deregistration)."""
        self._stop.set()
        self._closed.set()
        if wait_s > 0 and self._thread.is_alive():
            self._thread.join(wait_s)

    def _callback(self, _conn: libvirt.virConnect, dom: libvirt.virDomain, event: int, detail: int,
                  _opaque: object) -> None:
        # Runs on the event loop thread: translate and hand over, nothing slow.
        at = time.time()
        if event == libvirt.VIR_DOMAIN_EVENT_STOPPED and detail in _STOP_CAUSES:
            self.on_event(GuestEvent(self.name, dom.name(), "stopped", _STOP_CAUSES[detail], at))
        elif event == libvirt.VIR_DOMAIN_EVENT_SUSPENDED and detail in _PAUSE_CAUSES:
            self.on_event(GuestEvent(self.name, dom.name(), "paused", _PAUSE_CAUSES[detail], at))
        elif event == libvirt.VIR_DOMAIN_EVENT_CRASHED:
            self.on_event(GuestEvent(self.name, dom.name(), "stopped", "the guest crashed", at))

    def _run(self) -> None:
        reconnect = False
        while not self._stop.is_set():
            try:
                conn = libvirt.open(self.uri)
            except libvirt.libvirtError:
                self._stop.wait(self.retry_s)
                continue
            self._closed.clear()
            # Not every driver has these (test:/// has neither); the isAlive() poll below covers it.
            with contextlib.suppress(libvirt.libvirtError):
                conn.registerCloseCallback(lambda _c, _r, _o: self._closed.set(), None)
            with contextlib.suppress(libvirt.libvirtError):
                conn.setKeepAlive(2, 3)
            try:
                callback_id = conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                                          self._callback, None)
            except libvirt.libvirtError:
                with contextlib.suppress(libvirt.libvirtError):
                    conn.close()
                self._stop.wait(self.retry_s)
                continue
            self.connected.set()
            self.on_connect(self.name, reconnect)
            while not self._closed.wait(0.5):
                try:
                    if conn.isAlive() != 1:
                        break
                except libvirt.libvirtError:
                    break
            self.connected.clear()
            with contextlib.suppress(libvirt.libvirtError):
                conn.domainEventDeregisterAny(callback_id)
            with contextlib.suppress(libvirt.libvirtError):
                conn.unregisterCloseCallback()
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()
            reconnect = True
