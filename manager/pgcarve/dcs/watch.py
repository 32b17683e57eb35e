"""A background poll of etcd, so /metrics reads a recent answer without waiting for one.

One thread asks every endpoint every `interval_s` (each request bounded by `timeout_s`, the
endpoints in parallel), and keeps the last `ClusterHealth` and the last member list it saw, so a
member that stops answering still shows, as down.
"""

from __future__ import annotations

import logging
import threading

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EtcdClient, EtcdMember
from pgcarve.dcs.health import ClusterHealth, assess
from pgcarve.errors import PgcarveError

log = logging.getLogger("pgcarve.dcs")

POLL_INTERVAL_S = 5.0
POLL_TIMEOUT_S = 2.0


class EtcdWatch:
    def __init__(self, config: EtcdConfig, interval_s: float | None = None, timeout_s: float = POLL_TIMEOUT_S):
        self.config = config
        self.interval_s = interval_s if interval_s is not None else POLL_INTERVAL_S
        self.timeout_s = min(timeout_s, config.timeout_s)
        self._latest: ClusterHealth | None = None
        self._known: tuple[EtcdMember, ...] | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgcarve-etcd-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s * 3)

    def latest(self) -> ClusterHealth | None:
        """The last assessment (None before the first poll, or while the TLS files are unusable)."""
        with self._lock:
            return self._latest

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error

    def poll_once(self) -> ClusterHealth | None:
        try:
            with EtcdClient(self.config, timeout_s=self.timeout_s) as client:
                probe = client.probe()
        except PgcarveError as exc:  # our own TLS files: said once per change, not every poll
            with self._lock:
                changed, self._error, self._latest = self._error != str(exc), str(exc), None
            if changed:
                log.error("cannot poll etcd: %s", exc)
            return None
        with self._lock:
            if probe.members is not None:
                self._known = probe.members
            health = assess(probe, self._known)
            self._latest, self._error = health, None
        return health

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_s)
