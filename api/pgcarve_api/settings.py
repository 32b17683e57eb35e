"""API server settings (environment variables PGCARVE_*), behind a cached dependency."""

from __future__ import annotations

import functools
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PGCARVE_", extra="ignore")

    state_dir: Path = Path("/var/lib/pgcarve")
    hosts_file: Path | None = None
    bind: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None  # PGCARVE_TOKEN; else generated into <state_dir>/api-token
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
