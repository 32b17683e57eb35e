"""The hosts file (hosts.yaml): the fleet's configuration.

hosts.yaml says which libvirt hosts pgcarve carves and how: hosts by URI and role, the size of
each instance, how primaries replicate, what the HA loop does about faults. `pgcarve sandbox up`
writes one for its local hosts; `hosts.sample.yaml` at the repository root documents every field
for real hosts.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path, PurePosixPath
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pgcarve.addresses import check_address, check_network
from pgcarve.errors import ConfigError

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"
# PostgreSQL clusters one guest may run (instance.clusters), as the image's pgcarve-clusters accepts.
MAX_CLUSTERS = 16


class InstanceSize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    vcpus: int = Field(1, ge=1, le=256, description="vCPUs per guest, each pinned to its own host CPU")
    memory_mib: int = Field(1024, ge=256, le=4 * 1024 * 1024, description="guest memory in MiB")
    housekeeping_cpus: int | None = Field(
        None, ge=0, description="host CPUs kept for emulator threads; null = auto (1 core/socket on >= 8 CPUs)"
    )
    hugepages: bool = Field(False, description="back guest memory with 2 MiB hugepages")
    clusters: int = Field(
        1, ge=1, le=MAX_CLUSTERS,
        description="PostgreSQL clusters in each guest, on ports 5432 and up, each replicating to the same "
                    "cluster of its standbys (the benchmark's multi-instance case); the API and the manager "
                    "see only the first, and never fail over or switch over such an instance",
    )
    disk_gib: int = Field(8, ge=2, le=16384, description="virtual size of each guest's disk")
    disk_reserve_mib: int = Field(
        1024, ge=0, le=16 * 1024 * 1024,
        description="free space a host's storage pool must have for each new guest (its disk grows as it is written)",
    )


class Replication(BaseModel):
    model_config = ConfigDict(extra="forbid")
    standbys: int = Field(2, ge=0, le=4, description="standbys per primary, each on another host")
    sync_mode: Literal["FIRST", "ANY"] = "FIRST"
    sync_count: int = Field(1, ge=1, le=4, description="standbys that must confirm each commit")
    synchronous_commit: Literal["off", "local", "remote_write", "on", "remote_apply"] = "remote_write"
    roles: Literal["manager", "patroni"] = Field(
        "manager",
        description="who decides which guest of an instance is primary: Patroni inside each guest, its leader "
                    "key in the fleet's etcd (needs the etcd section), or the manager's HA loop (being replaced)")
    patroni_ttl_s: int = Field(
        20, ge=10, le=600,
        description="Patroni's leader key TTL: a primary that cannot renew it this long demotes itself and a "
                    "synchronous standby takes over (the watchdog resets it 5 s before)")
    patroni_loop_wait_s: int = Field(5, ge=1, le=60, description="how often each Patroni member runs its loop")
    patroni_retry_timeout_s: int = Field(
        5, ge=1, le=600, description="how long Patroni retries etcd and PostgreSQL before it demotes a leader")
    retire_catch_up_s: int = Field(
        120, ge=5, le=3600,
        description="scale-down: how long a synchronous standby may take to replay everything once writes are "
                    "fenced; after that the instance is not retired and accepts writes again")

    @model_validator(mode="after")
    def _count_fits(self) -> Replication:
        if self.standbys and self.sync_count > self.standbys:
            raise ValueError(f"sync_count {self.sync_count} exceeds standbys {self.standbys}")
        if self.patroni_loop_wait_s + 2 * self.patroni_retry_timeout_s > self.patroni_ttl_s:
            least = self.patroni_loop_wait_s + 2 * self.patroni_retry_timeout_s
            raise ValueError(f"patroni_ttl_s {self.patroni_ttl_s} must be at least patroni_loop_wait_s + 2 x "
                             f"patroni_retry_timeout_s ({least}), as Patroni requires")
        return self


class RecoveryPolicy(BaseModel):
    """What the manager does about faults: a guest stopped that nobody asked to stop, a host lost."""

    model_config = ConfigDict(extra="forbid")
    primary: Literal["restart", "failover"] = Field(
        "restart",
        description="a primary stopped on a host that answers: restart it from its disk (standbys reattach), "
                    "or fail over to a standby; a primary whose host is lost always fails over",
    )
    enabled: bool = Field(True, description="false: report faults but leave guests as they are")
    host_timeout_s: int = Field(
        30, ge=5, le=3600,
        description="a host whose libvirtd and guests do not answer this long is lost: its primaries fail over")
    fence_after_s: int = Field(
        30, ge=5, le=3600,
        description="a primary with no synchronous standby and no word from the manager this long stops accepting "
                    "writes (its guest's watchdog), so it cannot serve clients after a failover elsewhere")
    sync_switch_after_s: int = Field(
        5, ge=1, le=600,
        description="a synchronous standby not streaming this long is replaced by a streaming one (commits wait "
                    "meanwhile: never acknowledged without a synchronous standby)")
    sweep_interval_s: float = Field(
        15, ge=0.5, le=3600,
        description="how often the manager looks over every guest for faults that no libvirt event reported "
                    "(a lost host, a standby that stopped streaming, a former primary to rejoin)")
    retry_after_s: float = Field(
        30, ge=0, le=3600,
        description="a repair that failed is tried again this long after its last attempt, not on every sweep")
    refollow_grace_s: float = Field(
        60, ge=1, le=3600,
        description="a standby pointed at a new primary that still receives nothing this long later is rewound "
                    "(pg_rewind) instead of waiting longer")


class HostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    uri: str = Field(min_length=3, description="libvirt URI, e.g. qemu+ssh://root@db1/system")
    role: Literal["primary", "standby"] = "primary"
    pool: str = Field("pgcarve", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    pool_path: str = Field("/var/lib/libvirt/pgcarve", description="directory for pgcarve's volumes")
    network: str = Field("pgcarve", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="libvirt network for guests")
    # How the machine running pgcarve reaches guests: directly (routed), or through a local
    # forward into a sandbox namespace.
    reach: Literal["direct", "sandbox"] = "direct"
    netns: str | None = Field(None, description="sandbox only: the host's network namespace")
    core_offset: int = Field(default=0, ge=0, le=4096, description="slots start this many cores into each socket "
                             "(the sandbox sets it: its hosts share one machine's cores)")

    @field_validator("uri")
    @classmethod
    def _uri_shape(cls, value: str) -> str:
        # No whitespace, quotes or shell/markup characters anywhere: the URI reaches ssh and logs.
        if not re.fullmatch(r"[a-z][a-z0-9+]*://[A-Za-z0-9@%:/?&=._+,~-]*", value):
            raise ValueError(f"{value!r} is not a libvirt URI (like qemu:///system or "
                             "qemu+ssh://root@db1/system?keyfile=/root/.ssh/id)")
        return value

    @field_validator("netns")
    @classmethod
    def _netns_name(cls, value: str | None) -> str | None:
        if value is not None and (not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,62}", value)
                                  or value in (".", "..")):
            raise ValueError(f"{value!r} is not a network namespace name (letters, digits, '_', '-', '.')")
        return value


class EtcdConfig(BaseModel):
    """Where the fleet's etcd answers, and the files the manager proves itself with (TLS only)."""

    model_config = ConfigDict(extra="forbid")
    endpoints: list[str] = Field(
        min_length=1, max_length=16,
        description="client URLs of the etcd members (https://ADDRESS:PORT); three or more members keep a quorum "
                    "through the loss of one")
    guest_endpoints: list[str] | None = Field(
        None, max_length=16,
        description="the same members as the guests' Patroni reaches them, when not at `endpoints` (the sandbox's "
                    "manager reaches them through local forwards, its guests on the wire)")
    ca_file: str = Field(description="the CA certificate etcd's server certificates are checked against")
    cert_file: str = Field(description="the manager's client certificate (clientAuth), signed by a CA etcd trusts")
    key_file: str = Field(description="its private key (mode 0600)")
    timeout_s: float = Field(3.0, ge=0.2, le=60, description="how long one request to one member may take")
    manager_lease: bool = Field(
        False,
        description="several `pgcarve serve` share the fleet, one acting, through a lease in this etcd; off: one "
                    "manager per state directory (an flock). Off by default while the manager's own HA loop decides "
                    "roles: with the lease a manager stops acting when etcd loses its quorum, which losing two of "
                    "three hosts that also run etcd does, and that is when the HA loop has work to do")

    @field_validator("endpoints", "guest_endpoints")
    @classmethod
    def _endpoint_urls(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        for url in value:
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme != "https":
                raise ValueError(f"etcd endpoint {url!r} must start with https:// (etcd is reached over TLS only)")
            if not parts.hostname or port is None or parts.path not in ("", "/") or parts.query or parts.fragment \
                    or parts.username is not None:
                raise ValueError(f"etcd endpoint {url!r} is not https://ADDRESS:PORT (e.g. https://10.0.0.1:2379)")
        if len(set(value)) != len(value):
            raise ValueError(f"etcd endpoints are listed twice: {value}")
        return [url.rstrip("/") for url in value]

    def guest_hosts(self) -> tuple[str, ...]:
        """ADDRESS:PORT of each member as guests reach it."""
        return tuple(urlsplit(url).netloc for url in (self.guest_endpoints or self.endpoints))

    @field_validator("ca_file", "cert_file", "key_file")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not PurePosixPath(value).is_absolute():
            raise ValueError(f"{value!r} must be an absolute path (the manager may run from any directory)")
        return value


class BackupRepository(BaseModel):
    """Where every instance's backups and archived WAL go: an SFTP server (a repository host of its
    own, off every database host). The guests log in with the fleet's key pair and check the
    server's host key; neither the private key nor its path reaches tfvars or logs."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["sftp"] = Field("sftp", description="how guests reach the repository (SFTP only for now)")
    host: str = Field(description="the repository host's address, as the guests reach it")
    port: int = Field(22, ge=1, le=65535)
    user: str = Field("pgcarve", pattern=r"^[a-z_][a-z0-9_-]{0,31}$", description="the SFTP login")
    path: str = Field(description="the repository's directory on that host (absolute)")
    host_key: str = Field(description="the server's public host key, as in its .pub file: 'TYPE BASE64'")
    private_key_file: str = Field(
        description="the fleet's private key for the repository (absolute path on the manager's machine, "
                    "mode 0600); its public half, FILE.pub, must be authorized on the repository host")

    @field_validator("host")
    @classmethod
    def _address(cls, value: str) -> str:
        try:
            return check_address(value)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("path", "private_key_file")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not PurePosixPath(value).is_absolute() or any(c in value for c in "\n\r=#'\"$`\\ "):
            raise ValueError(f"{value!r} must be an absolute path without spaces, quotes, '=', '#' or '$'")
        return value

    @field_validator("host_key")
    @classmethod
    def _public_key(cls, value: str) -> str:
        fields = value.split()
        if len(fields) < 2 or not re.fullmatch(r"(ssh|ecdsa)-[a-z0-9-]+", fields[0]):
            raise ValueError("host_key must be 'TYPE BASE64' as in the server's ssh_host_*_key.pub "
                             "(e.g. 'ssh-ed25519 AAAA...')")
        try:
            base64.b64decode(fields[1], validate=True)
        except (ValueError, binascii.Error):
            raise ValueError("host_key's second field is not base64") from None
        return " ".join(fields[:2])


class BackupConfig(BaseModel):
    """Backups and WAL archiving of every instance (one repository for the fleet)."""

    model_config = ConfigDict(extra="forbid")
    repository: BackupRepository
    full_every_days: int = Field(7, ge=1, le=90, description="a full backup this often (the schedule; "
                                 "not run by the manager yet: take backups with `pgcarve backup`)")
    diff_every_hours: int = Field(24, ge=1, le=24 * 30, description="a differential backup this often")
    retention_full: int = Field(2, ge=1, le=100, description="full backups kept per instance (with the WAL "
                                "and the differential and incremental backups that depend on them)")
    retention_diff: int = Field(7, ge=1, le=1000, description="differential backups kept per instance")
    archive_queue_max_mib: int = Field(
        1024, ge=64, le=1024 * 1024,
        description="WAL waiting to be archived, per guest, beyond which it is dropped (the archive gets a gap, "
                    "the next backup is needed for recovery past it) instead of filling pg_wal and stopping "
                    "commits when the repository cannot be reached")

    @model_validator(mode="after")
    def _schedule(self) -> BackupConfig:
        if self.diff_every_hours > self.full_every_days * 24:
            raise ValueError(f"backup.diff_every_hours ({self.diff_every_hours}) is longer than the time between "
                             f"full backups ({self.full_every_days} days = {self.full_every_days * 24} h)")
        return self


class FleetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fleet: str = Field("pgc", pattern=r"^[a-z][a-z0-9]{0,15}$", description="prefix of every guest name")
    domain_type: Literal["auto", "kvm", "qemu"] = "auto"
    instance: InstanceSize = InstanceSize()
    replication: Replication = Replication()
    recovery: RecoveryPolicy = RecoveryPolicy()
    allowed_cidrs: list[str] = Field(default_factory=lambda: ["10.77.0.0/16"],
                                     description="networks allowed to log in to PostgreSQL")
    etcd: EtcdConfig | None = Field(None, description="the fleet's etcd (Patroni's leader keys); doctor needs it")
    backup: BackupConfig | None = Field(None, description="backups and WAL archiving; none: instances are not "
                                        "backed up")
    hosts: list[HostConfig]

    @field_validator("allowed_cidrs")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        try:
            return [check_network(cidr) for cidr in value]
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _hosts_consistent(self) -> FleetConfig:
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        if not any(h.role == "primary" for h in self.hosts):
            raise ValueError("at least one host needs role: primary")
        standby_hosts = [h for h in self.hosts if h.role == "standby"]
        if self.replication.roles == "patroni":
            if self.etcd is None:
                raise ValueError("replication.roles: patroni needs the etcd section "
                                 "(Patroni keeps its leader key there)")
            if self.instance.clusters != 1:
                raise ValueError("replication.roles: patroni runs one PostgreSQL cluster per guest; "
                                 f"instance.clusters is {self.instance.clusters}")
        if self.replication.standbys > len(standby_hosts):
            raise ValueError(
                f"replication.standbys is {self.replication.standbys} but only {len(standby_hosts)} "
                "host(s) have role: standby (standbys never share their primary's host)"
            )
        return self

    def host(self, name: str) -> HostConfig:
        for host in self.hosts:
            if host.name == name:
                return host
        raise ConfigError(f"no host named {name!r} in the hosts file (hosts: {[h.name for h in self.hosts]})")

    @property
    def primary_hosts(self) -> list[HostConfig]:
        return [h for h in self.hosts if h.role == "primary"]

    @property
    def standby_hosts(self) -> list[HostConfig]:
        return [h for h in self.hosts if h.role == "standby"]


def load_fleet_config(path: Path) -> FleetConfig:
    """Read and validate a hosts file; errors name the file and the field."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"hosts file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"hosts file {path} is not valid YAML: {exc}") from None
    try:
        return FleetConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"hosts file {path}: {problems}") from None


def write_fleet_config(config: FleetConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
