"""What goes into a guest's NoCloud seed: identity, role, TLS and PostgreSQL configuration.

The seed is the only channel from the manager into a new guest: a NoCloud seed whose cloud-config
write_files entry carries `instance.json`, which the image's pgcarve-guest-setup unit reads from the
seed disk and writes to /etc/pgcarve/ (mode 0600) before PostgreSQL starts (see
images/rootfs/usr/local/sbin/pgcarve-guest-setup). Passwords travel
as SCRAM-SHA-256 verifiers, never in plain text, except the replication password a standby needs
to log in to its primary. The guest's server certificate and private key (from the fleet CA) and
the CA's certificate travel in it too: the key exists only in this seed and in the guest.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pgcarve.addresses import check_address, check_network
from pgcarve.config import MAX_CLUSTERS, FleetConfig
from pgcarve.errors import ConfigError
from pgcarve.guest.credentials import Credentials, InstanceSecrets
from pgcarve.guest.tls import KeyAndCertificate
from pgcarve.naming import slot_name
from pgcarve.postgres.session import APP_DATABASE, APP_USER

INSTANCE_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}$")
SCRAM_ITERATIONS = 4096
Role = Literal["primary", "standby"]


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for `password` (RFC 5802 / RFC 7677)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


@dataclass(frozen=True)
class PatroniSeed:
    """What a guest's Patroni needs (its configuration is written in the guest from this)."""

    scope: str  # the instance: one Patroni cluster per instance
    etcd_hosts: tuple[str, ...]  # ADDRESS:PORT of each etcd member
    rest_password: str = field(repr=False)
    synchronous_mode: Literal["on", "quorum", "off"] = "on"
    synchronous_node_count: int = 1
    ttl: int = 20
    loop_wait: int = 5
    retry_timeout: int = 5

    def __post_init__(self) -> None:
        if not self.etcd_hosts:
            raise ConfigError(f"{self.scope}: Patroni needs at least one etcd member")
        for host in self.etcd_hosts:
            address, _, port = host.rpartition(":")
            check_address(address)
            if not port.isdigit():
                raise ConfigError(f"{self.scope}: etcd member {host!r} is not ADDRESS:PORT")

    def document(self, replication_password: str) -> dict[str, object]:
        return {"scope": self.scope, "etcd_hosts": list(self.etcd_hosts), "rest_password": self.rest_password,
                "replication_password": replication_password, "synchronous_mode": self.synchronous_mode,
                "synchronous_node_count": self.synchronous_node_count, "ttl": self.ttl,
                "loop_wait": self.loop_wait, "retry_timeout": self.retry_timeout}


def patroni_seed(config: FleetConfig, instance: str, secrets: InstanceSecrets) -> PatroniSeed | None:
    """The Patroni part of `instance`'s seeds, from the hosts file; None when the manager decides
    roles. FIRST k maps to Patroni's synchronous mode with k synchronous standbys, ANY k to its
    quorum mode (Patroni 4): a standby is promoted only with the proof a quorum gives."""
    replication = config.replication
    if replication.roles != "patroni":
        return None
    if config.etcd is None:
        raise ConfigError("replication.roles: patroni needs the hosts file's etcd section")
    if secrets.patroni_password is None:
        raise ConfigError(f"{instance} was made before Patroni ran its guests (no Patroni password recorded); "
                          "scale it away and create it again")
    synchronous = replication.standbys > 0 and replication.synchronous_commit not in ("off", "local")
    mode: Literal["on", "quorum", "off"] = "off"
    if synchronous:
        mode = "quorum" if replication.sync_mode == "ANY" else "on"
    return PatroniSeed(scope=instance, etcd_hosts=config.etcd.guest_hosts(), rest_password=secrets.patroni_password,
                       synchronous_mode=mode, synchronous_node_count=replication.sync_count,
                       ttl=replication.patroni_ttl_s, loop_wait=replication.patroni_loop_wait_s,
                       retry_timeout=replication.patroni_retry_timeout_s)


@dataclass(frozen=True)
class GuestSeed:
    """Everything one guest needs to configure itself on first boot."""

    name: str
    role: Role
    credentials: Credentials  # the fleet's admin password
    allowed_cidrs: tuple[str, ...]
    secrets: InstanceSecrets = field(repr=False)  # its instance's application and replication passwords
    tls: KeyAndCertificate = field(repr=False)  # the guest's server key and certificate
    ca_pem: bytes = field(repr=False)  # the fleet CA's certificate
    synchronous_commit: str = "remote_write"
    synchronous_standby_names: str = ""
    primary_host: str | None = None  # standbys: the primary's address
    # PostgreSQL clusters in the guest, on ports 5432.. (the benchmark's multi-instance case; the
    # image's pgcarve-clusters makes the ones beyond the first).
    clusters: int = 1
    # standbys: this guest's data directory was a primary of the instance (fenced or lost in a
    # failover); rewind it onto primary_host (pg_rewind) instead of cloning a fresh copy.
    rejoin: bool = False
    # primaries: stop accepting writes after this long with neither a synchronous standby nor
    # word from the manager (the guest's watchdog, pgcarve-watchdog).
    fence_after_s: int = 30
    # Guests laid out by Terraform, where no manager step runs: the addresses of the instance's
    # other guests, let in to replicate from first boot (the manager writes them at run time),
    # and, for a standby, that it makes its own replication slot as it clones (pg_basebackup -C).
    replication_peers: tuple[str, ...] = ()
    create_slot: bool = False
    # A standby of a primary made at the same time from the same image: its own data directory
    # (the image's, untouched) is where the primary starts from, so it streams without a copy.
    from_image: bool = False
    # Patroni runs PostgreSQL and decides roles (replication.roles: patroni); None: the manager does.
    patroni: PatroniSeed | None = None
    # WAL archiving and backups (backup/pgbackrest.py seed_document: files to write as they are, the
    # archive_command, the fleet's repository key); None: the fleet has no backup section.
    backup: dict[str, object] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not INSTANCE_NAME_RE.fullmatch(self.name):
            raise ConfigError(
                f"instance name {self.name!r} is invalid: lower-case letters, digits and '-', "
                "starting with a letter, at most 63 characters"
            )
        for cidr in self.allowed_cidrs:
            check_network(cidr)
        if self.role == "standby":
            if self.primary_host is None:
                raise ConfigError(f"standby {self.name} needs its primary's address")
            check_address(self.primary_host)
        elif self.rejoin:
            raise ConfigError(f"{self.name}: only a standby can rejoin its instance")
        elif self.create_slot:
            raise ConfigError(f"{self.name}: only a standby makes its own replication slot")
        elif self.from_image:
            raise ConfigError(f"{self.name}: only a standby starts from the image's data directory")
        if self.from_image and (self.rejoin or self.create_slot):
            raise ConfigError(f"{self.name}: a standby starting from the image neither rejoins nor makes its slot")
        for address in self.replication_peers:
            check_address(address)
        if not 1 <= self.clusters <= MAX_CLUSTERS:
            raise ConfigError(f"{self.name}: clusters must be 1..{MAX_CLUSTERS}, not {self.clusters}")
        if not 5 <= self.fence_after_s <= 3600:
            raise ConfigError(f"{self.name}: fence_after_s {self.fence_after_s} must be 5..3600 seconds")
        for pem, kind in ((self.tls.cert_pem, "CERTIFICATE"), (self.ca_pem, "CERTIFICATE"),
                          (self.tls.key_pem, "PRIVATE KEY")):
            if not pem.startswith(f"-----BEGIN {kind}-----".encode()):
                raise ConfigError(f"the seed for {self.name} needs a PEM {kind.lower()}")

    def instance_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "name": self.name,
            "role": self.role,
            "allowed_cidrs": list(self.allowed_cidrs),
            "admin_password_scram": scram_verifier(self.credentials.admin_password),
            "replication_password_scram": scram_verifier(self.secrets.replication_password),
            "synchronous_commit": self.synchronous_commit,
            "synchronous_standby_names": self.synchronous_standby_names,
            "fence_after_s": self.fence_after_s,
            "tls_certificate": self.tls.cert_pem.decode(),
            "tls_private_key": self.tls.key_pem.decode(),
            "tls_ca": self.ca_pem.decode(),
            # Every guest lets the application role in (to its own database only): reads go to standbys.
            "app_user": APP_USER,
            "app_database": APP_DATABASE,
        }
        if self.patroni is not None:
            doc["patroni"] = self.patroni.document(self.secrets.replication_password)
        if self.backup is not None:
            doc["backup"] = dict(self.backup)
        if self.clusters > 1:  # absent means one: seeds of ordinary guests stay as they were
            doc["clusters"] = self.clusters
        if self.replication_peers:
            doc["replication_peers"] = list(self.replication_peers)
        if self.role == "primary":
            # The role and its database are made on the primary's first boot, and replicate.
            doc["app_password_scram"] = scram_verifier(self.secrets.app_password)
        if self.role == "standby":
            doc["primary_host"] = self.primary_host
            doc["replication_password"] = self.secrets.replication_password
            doc["slot_name"] = slot_name(self.name)
            doc["rejoin"] = self.rejoin
            if self.create_slot:
                doc["create_slot"] = True
            if self.from_image:
                doc["from_image"] = True
        return doc

    def meta_data(self, instance_id: str) -> str:
        return json.dumps({"instance-id": instance_id, "local-hostname": self.name}, indent=2) + "\n"

    def user_data(self) -> str:
        """cloud-config (JSON is valid YAML, so no YAML emitter quirks reach the guest)."""
        config = {
            "write_files": [
                {
                    "path": "/etc/pgcarve/instance.json",
                    "permissions": "0600",
                    "owner": "root:root",
                    "content": json.dumps(self.instance_json(), indent=2, sort_keys=True) + "\n",
                }
            ],
        }
        return "#cloud-config\n" + json.dumps(config, indent=2, sort_keys=True) + "\n"


def write_seed_iso(seed: GuestSeed, instance_id: str, path: Path) -> None:
    """A NoCloud seed (ISO 9660, volume label "cidata") with user-data and meta-data.

    Its inputs are written beside `path` (0600 from their creation: user-data holds secrets)
    and removed after; the ISO names them through graft points. No directory of its own: at
    a thousand guests a scale-up spent more on making and removing directories than on this."""
    if shutil.which("genisoimage") is None:
        raise ConfigError("genisoimage is needed to build guest seeds: run `make deps`")
    user_data = path.with_name(f".{path.name}.user-data")
    meta_data = path.with_name(f".{path.name}.meta-data")
    try:
        for file, text, mode in ((user_data, seed.user_data(), 0o600), (meta_data, seed.meta_data(instance_id), 0o644)):
            file.unlink(missing_ok=True)
            with os.fdopen(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as fh:
                fh.write(text)
        proc = subprocess.run(
            ["genisoimage", "-quiet", "-output", str(path), "-volid", "cidata", "-joliet", "-rock",
             "-graft-points", f"user-data={user_data}", f"meta-data={meta_data}"],
            capture_output=True, text=True, check=False,
        )
    finally:
        user_data.unlink(missing_ok=True)
        meta_data.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise ConfigError(f"building the seed for {seed.name} failed: {proc.stderr.strip()}")
