"""API server settings (environment variables PGCARVE_*), behind a cached dependency.

The manager's own settings (state directory, image, hosts file, boot timeout, bind, port,
token) come from pgcarve.settings.Settings; the API adds how it serves (names, TLS) and polls.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pgcarve.settings import Settings as ManagerSettings


class Settings(ManagerSettings):
    refresh_s: float = 2.0
    collect: bool = True
    collect_interval_s: float = 1.0
    waits_hz: float = 5.0  # PGCARVE_WAITS_HZ: samples of each primary's waits per second (0: none)
    supervise: bool = True  # PGCARVE_SUPERVISE=0: no HA loop (faults are neither noticed nor repaired)
    max_body_bytes: int = 64 * 1024
    # PGCARVE_ALLOWED_HOSTS: more names or addresses clients may use in the Host header, comma-separated,
    # beside the bind address (and localhost on loopback); they also go into the API's certificate.
    allowed_hosts: str = ""
    # PGCARVE_TLS_CERT / PGCARVE_TLS_KEY: the operator's own certificate (PEM, chain included) and key,
    # both or neither. Without them, off loopback the API serves a certificate from the fleet CA.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # PGCARVE_ADVERTISE_URL: the URL other managers' 503s name for this one while it leads (the leader
    # key in etcd); default: the URL it listens on, which is only right for clients on this machine.
    advertise_url: str | None = None

    @property
    def extra_host_names(self) -> list[str]:
        return [name.strip() for name in self.allowed_hosts.replace(" ", ",").split(",") if name.strip()]


@functools.cache
def get_settings() -> Settings:
    return Settings()
