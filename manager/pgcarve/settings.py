"""Process settings and where pgcarve keeps its state.

`Settings` is read once when a process starts (PGCARVE_* environment variables) and passed down;
nothing reads the environment at import time. `Paths` names the files in the state directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, PositiveFloat
from pydantic_settings import BaseSettings, SettingsConfigDict


class Paths:
    """Where pgcarve keeps its state: the state directory and the guest image's directory."""

    def __init__(self, state_dir: Path, image_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.image_dir = image_dir if image_dir is not None else state_dir / "image"

    @property
    def sandbox_dir(self) -> Path:
        return self.state_dir / "sandbox"

    @property
    def sandbox_hosts_file(self) -> Path:
        return self.sandbox_dir / "hosts.yaml"

    @property
    def secrets_file(self) -> Path:
        return self.state_dir / "secrets.json"

    @property
    def instance_secrets_dir(self) -> Path:
        """Each instance's own passwords, one 0600 file per instance (pgcarve.guest.credentials)."""
        return self.state_dir / "instances"

    @property
    def token_file(self) -> Path:
        return self.state_dir / "api-token"

    @property
    def tls_dir(self) -> Path:
        """The fleet CA (ca.key, ca.pem) and the certificates it issued (pgcarve.guest.tls)."""
        return self.state_dir / "tls"

    @property
    def probe_cache(self) -> Path:
        return self.state_dir / "domain-type-probe.json"

    @property
    def server_file(self) -> Path:
        """The server clients talk to (the latest started that still runs)."""
        return self.state_dir / "server.json"

    @property
    def servers_dir(self) -> Path:
        """One record per running server (several may serve one state directory with etcd), so
        `pgcarve server stop` finds every one of them."""
        return self.state_dir / "servers"


class Settings(BaseSettings):
    """PGCARVE_* settings of one process (the API server adds its own in pgcarve_api.settings)."""

    model_config = SettingsConfigDict(env_prefix="PGCARVE_", extra="ignore")

    state_dir: Path = Path("/var/lib/pgcarve")  # where pgcarve keeps its state
    image_dir: Path | None = None  # the guest image (default <state_dir>/image)
    hosts_file: Path | None = None  # hosts.yaml (default ./hosts.yaml, else the sandbox's)
    boot_timeout: PositiveFloat = 600.0  # seconds a new guest may take to accept SQL
    fleet_key_file: Path | None = None  # the key `pgcarve state export` / `import` encrypt with
    token: str | None = None  # the API token, >= 32 characters (else the state directory's api-token file)
    bind: str = "127.0.0.1"  # address the API server listens on
    port: Annotated[int, Field(ge=1, le=65535)] = 8080  # port the API server listens on

    @property
    def paths(self) -> Paths:
        return Paths(self.state_dir, self.image_dir)

    def hosts_file_path(self, explicit: str | Path | None = None) -> Path:
        """The hosts file to use: --hosts-file, PGCARVE_HOSTS_FILE, ./hosts.yaml, else the sandbox's."""
        for candidate in (explicit, self.hosts_file):
            if candidate:
                return Path(candidate)
        if Path("hosts.yaml").exists():
            return Path("hosts.yaml")
        return self.paths.sandbox_hosts_file
