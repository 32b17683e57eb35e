"""A real etcd and real Patroni members on 127.0.0.1, for tests/integration/test_patroni_local.py
and for recording Patroni's keys (tests/data/patroni/).

Everything speaks TLS with certificates from a throw-away CA (pgcarve.guest.tls): etcd checks
client certificates, as the sandbox's members do; Patroni's REST API serves TLS and asks for
basic authentication on what changes things. Patroni runs as `postgres` through setpriv, with no
PGPASSWORD in its environment (it would override Patroni's own pgpass file, PLATFORM.md). Every
process is started here and stopped by its PID; a postmaster Patroni leaves running (Patroni
leaves PostgreSQL up when it stops in a paused cluster) is stopped by its postmaster.pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.errors import DcsUnavailable
from pgcarve.guest.tls import KeyAndCertificate, issue_certificate, new_ca, write_key_and_certificate

from tests.support import localpg

PATRONI = shutil.which("patroni") or "/usr/bin/patroni"
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
API_USER = "pgcarve"
API_PASSWORD = "patroni-api-test-password"  # a throw-away cluster on loopback
# Patroni's own floors: ttl >= 20, loop_wait >= 1, retry_timeout >= 3; a short loop makes
# switchovers and pauses show within a second or two.
DCS_SETTINGS = {"ttl": 20, "loop_wait": 1, "retry_timeout": 5, "maximum_lag_on_failover": 1048576,
                "synchronous_mode": True, "failsafe_mode": True}


def available() -> bool:
    return Path(PATRONI).exists() and Path(ETCD).exists() and localpg.available()


def _stop_pid(proc: subprocess.Popen[bytes] | None, wait_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 5.0)):
        os.kill(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class Certificates:
    """The throw-away CA and what it issued, as files the postgres user can read."""

    directory: Path
    ca: KeyAndCertificate = field(default_factory=new_ca)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "ca.pem").write_bytes(self.ca.cert_pem)

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def issue(self, name: str, *, server: bool, client: bool) -> tuple[Path, Path]:
        issued = issue_certificate(self.ca, common_name=name, ip_addresses=["127.0.0.1"] if server else [],
                                   server=server, client=client)
        cert, key = write_key_and_certificate(self.directory, name, issued)
        if os.geteuid() == 0:
            shutil.chown(key, "postgres", "postgres")  # Patroni reads them as postgres
        return cert, key


@dataclass
class LocalEtcd:
    directory: Path
    client_port: int
    peer_port: int
    certs: Certificates
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.client_port}"

    def client_config(self) -> EtcdConfig:
        cert, key = self.certs.issue("manager", server=False, client=True)
        return EtcdConfig(endpoints=[self.endpoint], ca_file=str(self.certs.ca_file), cert_file=str(cert),
                          key_file=str(key), timeout_s=5.0)

    def start(self) -> None:
        cert, key = self.certs.issue("etcd", server=True, client=True)
        peer = f"http://127.0.0.1:{self.peer_port}"  # one member: no peer ever dials it
        args = [ETCD, "--name", "local", "--data-dir", str(self.directory / "data"),
                "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"local={peer}", "--initial-cluster-state", "new",
                "--cert-file", str(cert), "--key-file", str(key), "--trusted-ca-file", str(self.certs.ca_file),
                "--client-cert-auth", "--logger", "zap", "--log-outputs", "stderr"]
        self.directory.mkdir(parents=True, exist_ok=True)
        with (self.directory / "etcd.log").open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, config: EtcdConfig, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        with EtcdClient(config, timeout_s=2.0) as client:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited: {(self.directory / 'etcd.log').read_text()[-2000:]}")
                try:
                    if client.status(self.endpoint).healthy:
                        return
                except DcsUnavailable:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.1)

    def stop(self) -> None:
        _stop_pid(self.proc, 10.0)
        self.proc = None


@dataclass
class LocalPatroni:
    """One Patroni member: its PostgreSQL on `pg_port`, its REST API on `api_port`."""

    scope: str
    name: str
    directory: Path
    pg_port: int
    api_port: int
    etcd: LocalEtcd
    dcs: dict[str, object] = field(default_factory=lambda: dict(DCS_SETTINGS))
    command: tuple[str, ...] = (PATRONI,)  # or another Patroni's (recording its keys)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_file(self) -> Path:
        return self.directory / "patroni.log"

    def config(self) -> dict[str, object]:
        certs = self.etcd.certs
        etcd_cert, etcd_key = certs.issue(f"{self.name}-etcd", server=False, client=True)
        api_cert, api_key = certs.issue(f"{self.name}-api", server=True, client=False)
        return {
            "scope": self.scope, "name": self.name,
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd.client_port}"], "protocol": "https",
                      "cacert": str(certs.ca_file), "cert": str(etcd_cert), "key": str(etcd_key)},
            "restapi": {"listen": f"127.0.0.1:{self.api_port}", "connect_address": f"127.0.0.1:{self.api_port}",
                        "certfile": str(api_cert), "keyfile": str(api_key),
                        "authentication": {"username": API_USER, "password": API_PASSWORD}},
            # How this member's Patroni checks its peers' REST APIs (before a switchover).
            "ctl": {"cacert": str(certs.ca_file)},
            "bootstrap": {
                "dcs": self.dcs | {"postgresql": {"use_pg_rewind": True, "use_slots": True, "parameters": {
                    "fsync": "off", "full_page_writes": "off", "synchronous_commit": "remote_write",
                    "shared_buffers": "16MB", "max_connections": 20, "wal_log_hints": "on"}}},
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "data-checksums"],
                "pg_hba": ["host replication replicator 127.0.0.1/32 scram-sha-256",
                           "host all all 127.0.0.1/32 scram-sha-256"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}", "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data_dir), "bin_dir": str(localpg.PG_BIN),
                "pgpass": str(self.directory / "pgpass"),
                "authentication": {"superuser": {"username": "postgres", "password": "pg-test-superuser"},
                                   "replication": {"username": "replicator", "password": "pg-test-replicator"},
                                   "rewind": {"username": "postgres", "password": "pg-test-superuser"}},
                "parameters": {"unix_socket_directories": str(self.directory)},
            },
            "watchdog": {"mode": "off"},  # this host has no /dev/watchdog
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config_file = self.directory / "patroni.yml"
        config_file.write_text(json.dumps(self.config(), indent=1))  # JSON is YAML
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")
            shutil.chown(config_file, "postgres", "postgres")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no PGPASSWORD, PGHOST...
        args = [*self.command, str(config_file)]
        if os.geteuid() == 0:
            args = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *args]
        with self.log_file.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.directory)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        return self.log_file.read_text(errors="replace")[-3000:] if self.log_file.exists() else ""

    def stop(self) -> None:
        """Patroni by its PID (it stops its PostgreSQL), then its postmaster by postmaster.pid if
        it is still there (Patroni leaves it running in a paused cluster)."""
        _stop_pid(self.proc, 30.0)
        self.proc = None
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)


@dataclass
class LocalPatroniCluster:
    """etcd and members of one scope under `base` (created with localpg.prepare_base)."""

    base: Path
    scope: str
    member_names: tuple[str, ...]
    dcs: dict[str, object] = field(default_factory=lambda: dict(DCS_SETTINGS))
    command: tuple[str, ...] = (PATRONI,)
    etcd: LocalEtcd = field(init=False)
    members: list[LocalPatroni] = field(default_factory=list)
    etcd_config: EtcdConfig | None = None

    def __post_init__(self) -> None:
        ports = localpg.free_ports(2 + 2 * len(self.member_names))
        certs = Certificates(self.base / "tls")
        self.etcd = LocalEtcd(self.base / "etcd", ports[0], ports[1], certs)
        for i, name in enumerate(self.member_names):
            self.members.append(LocalPatroni(self.scope, name, self.base / name, ports[2 + 2 * i],
                                             ports[3 + 2 * i], self.etcd, dict(self.dcs), self.command))

    def start(self) -> EtcdConfig:
        self.etcd.start()
        self.etcd_config = self.etcd.client_config()
        self.etcd.wait_ready(self.etcd_config)
        for member in self.members:
            member.start()
        return self.etcd_config

    def member(self, name: str) -> LocalPatroni:
        return next(m for m in self.members if m.name == name)

    def stop(self) -> None:
        # Standbys first, so the leader is not left waiting for a synchronous one that is stopping.
        for member in reversed(self.members):
            member.stop()
        self.etcd.stop()
