"""API server settings (environment variables PGCARVE_*), behind a cached dependency.

The manager's own settings (state directory, image, hosts file, boot timeout, bind, port,
token) come from pgcarve.settings.Settings; the API adds how it serves and polls.
"""

from __future__ import annotations

import functools

from pgcarve.settings import Settings as ManagerSettings


class Settings(ManagerSettings):
    refresh_s: float = 2.0
    collect: bool = True
    collect_interval_s: float = 1.0
    supervise: bool = True  # PGCARVE_SUPERVISE=0: no HA loop (faults are neither noticed nor repaired)
    max_body_bytes: int = 64 * 1024

    @property
    def loopback_only(self) -> bool:
        return self.bind in ("127.0.0.1", "::1", "localhost")


@functools.cache
def get_settings() -> Settings:
    return Settings()
