"""etcd in the sandbox: one member per sandbox host, in that host's namespace, plus witnesses.

Each member listens on its wire address (10.76.0.N) for peers (2380) and clients (2379), over TLS
both ways with certificates from the fleet CA: a member's certificate names its wire address and
127.0.0.1 and serves as server and client (members dial each other), and the manager has a client
certificate of its own (`<state>/tls/etcd-client.pem`). Guests reach the members the way they reach
other hosts' guests: through their host, which routes the wire. The manager reaches them through
127.0.0.1 forwards (sandbox/forward.py, one per member, kept for the sandbox's life) with the unix
transport, and directly on the wire from its namespace with `--transport ssh`; the sandbox itself
always uses the forwards.

Quorum needs three members: a sandbox of one or two hosts gets one or two witnesses, each a
member alone in a small namespace of its own on the wire (10.76.0.241, .242). A sandbox grown
later (`sandbox up --hosts` more) adds its new hosts' members to the running cluster.

Timing, for a 2-core machine whose cores emulated guests keep busy: heartbeats every 500 ms and an
election after 5 s without one (etcd's defaults are 100 ms and 1 s, for dedicated machines). A
member starved of CPU for a second or two then neither loses nor forces a leader election; a lost
leader is replaced within about 5-10 s, inside Patroni's retry window. --pre-vote keeps a member
that was cut off from disrupting the leader when it returns.

Members run under the sandbox's reaper and are recorded (PID, start time, boot) beside their data
(`<sandbox>/etcd/<name>/`); they are stopped by that record only.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pgcarve.processes as processes
from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.dcs.health import MIN_MEMBERS, ClusterHealth, assess
from pgcarve.errors import DcsUnavailable, PgcarveError, SandboxError
from pgcarve.guest.tls import FleetCA, write_key_and_certificate
from pgcarve.processes import ProcessRecord
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.sandbox.namespaces import (
    NETNS_DIR,
    adopt_daemon,
    netns_exists,
    run_checked,
    stop_namespace_processes,
)

MAX_HOSTS = 8  # as sandbox/hosts.py: every guest network a witness may have to answer
CLIENT_PORT = 2379
PEER_PORT = 2380
HEARTBEAT_MS = 500
ELECTION_MS = 5000
WITNESS_ADDRESS = "10.76.0.{n}"  # witness k (1, 2) at .240+k
MANAGER_CERT = "etcd-client"  # <state>/tls/etcd-client.pem and .key: the manager's client certificate
READY_TIMEOUT_S = 90.0

# Runs inside the member's namespace: start etcd in the background, log to a file, write its PID.
_START = 'log=$1; pid=$2; shift 2; etcd "$@" >>"$log" 2>&1 </dev/null & echo $! >"$pid"'


@dataclass(frozen=True)
class MemberSpec:
    """One sandbox etcd member: where it runs and where its files are."""

    name: str  # h0, h1, ... or witness1, witness2
    netns: str
    address: str  # on the wire
    directory: Path  # <sandbox>/etcd/<name>
    witness: bool = False

    @property
    def peer_url(self) -> str:
        return f"https://{self.address}:{PEER_PORT}"

    @property
    def client_url(self) -> str:
        return f"https://{self.address}:{CLIENT_PORT}"

    @property
    def record_file(self) -> Path:
        return self.directory / "etcd.json"

    @property
    def forward_name(self) -> str:
        return f"etcd-{self.name}"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "directory": str(self.directory)})

    @classmethod
    def read(cls, path: Path) -> MemberSpec | None:
        try:
            doc = json.loads(path.read_text())
            return cls(str(doc["name"]), str(doc["netns"]), str(doc["address"]), Path(doc["directory"]),
                       bool(doc.get("witness", False)))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def plan_members(root: Path, tag: str, hosts: Sequence[tuple[str, str, str]]) -> list[MemberSpec]:
    """One member per host (name, netns, wire address), then witnesses until there are
    MIN_MEMBERS. Pure."""
    members = [MemberSpec(name, netns, address, root / name) for name, netns, address in hosts]
    for k in range(1, MIN_MEMBERS - len(members) + 1):
        name = f"witness{k}"
        members.append(MemberSpec(name, f"pgc-{tag}-{name}", WITNESS_ADDRESS.format(n=240 + k), root / name, True))
    return members


def member_args(member: MemberSpec, cluster: Sequence[MemberSpec], token: str, new: bool) -> list[str]:
    """etcd's command line for `member` in `cluster` (every member, this one included). Pure."""
    tls = member.directory / "tls"
    return [
        "--name", member.name, "--data-dir", str(member.directory / "data"),
        "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
        "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
        "--initial-cluster", ",".join(f"{m.name}={m.peer_url}" for m in cluster),
        "--initial-cluster-token", token, "--initial-cluster-state", "new" if new else "existing",
        "--cert-file", str(tls / "member.pem"), "--key-file", str(tls / "member.key"),
        "--trusted-ca-file", str(tls / "ca.pem"), "--client-cert-auth",
        "--peer-cert-file", str(tls / "member.pem"), "--peer-key-file", str(tls / "member.key"),
        "--peer-trusted-ca-file", str(tls / "ca.pem"), "--peer-client-cert-auth",
        "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS), "--pre-vote",
        # Patroni rewrites its keys every few seconds: keep an hour of history, not all of it.
        "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
        "--snapshot-count", "10000", "--logger", "zap", "--log-outputs", "stderr",
    ]


class SandboxEtcd:
    """The etcd members of one sandbox (`<sandbox>/etcd/`)."""

    def __init__(self, sandbox_dir: Path, tag: str, wire_netns: str, ca: FleetCA, forwards: ForwardRegistry):
        self.root = sandbox_dir / "etcd"
        self.tag = tag
        self.wire_netns = wire_netns
        self.ca = ca
        self.forwards = forwards

    # -- what exists ---------------------------------------------------------------------------

    def members(self) -> list[MemberSpec]:
        """The members this sandbox made (hosts' first, then witnesses), from their directories."""
        found = [m for p in sorted(self.root.glob("*/member.json")) if (m := MemberSpec.read(p)) is not None]
        return sorted(found, key=lambda m: (m.witness, m.name))

    def member(self, name: str) -> MemberSpec:
        for member in self.members():
            if member.name == name:
                return member
        raise SandboxError(f"no sandbox etcd member named {name!r} (members: "
                           f"{', '.join(m.name for m in self.members()) or 'none'})")

    def running(self, member: MemberSpec) -> ProcessRecord | None:
        return processes.running_record(member.record_file)

    @property
    def client_files(self) -> tuple[Path, Path, Path]:
        """(CA, certificate, key) the manager uses."""
        return self.ca.cert_file, self.ca.directory / f"{MANAGER_CERT}.pem", self.ca.directory / f"{MANAGER_CERT}.key"

    def config(self, direct: bool) -> EtcdConfig:
        """The hosts file's etcd section: members by wire address (`direct`, as from the ssh
        manager's namespace), else by their 127.0.0.1 forwards."""
        ca, cert, key = self.client_files
        endpoints = [m.client_url if direct else f"https://127.0.0.1:{self.forwards.port(m.forward_name)}"
                     for m in self.members()]
        on_wire = [m.client_url for m in self.members()]
        return EtcdConfig(endpoints=endpoints, guest_endpoints=None if direct else on_wire,
                          ca_file=str(ca), cert_file=str(cert), key_file=str(key))

    # -- up ------------------------------------------------------------------------------------

    def up(self, hosts: Sequence[tuple[str, str, str]], progress: Callable[[str], None]) -> None:
        """Members for these hosts (name, netns, wire address) running, and the cluster healthy;
        idempotent. A first start forms the cluster (with witnesses if needed); later hosts join it."""
        existing = self.members()
        self._client_certificate()
        if not existing:
            cluster = plan_members(self.root, self.tag, hosts)
            progress(f"etcd: {len(cluster)} members ({', '.join(m.name for m in cluster)})")
            for member in cluster:
                self._prepare(member)
            for member in cluster:
                self._start(member, cluster, new=True)
        else:
            for member in existing:  # a member stopped (a test, a crash) starts again from its data
                self.start_member(member.name)
            known = {m.name for m in existing}
            for name, netns, address in hosts:
                if name in known:
                    continue
                member = MemberSpec(name, netns, address, self.root / name)
                progress(f"etcd: adding member {name} to the running cluster")
                self._add(member)
                self._prepare(member)
                existing = [*existing, member]
                self._start(member, existing, new=False)
        self.wait_healthy()

    def _add(self, member: MemberSpec, timeout_s: float = 30) -> None:
        """Announce `member` to the cluster. etcd refuses while any member has been connected for
        less than 5 s (--strict-reconfig-check: "unhealthy cluster"), so a cluster that just
        started is asked again."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.wait_healthy()
            try:
                with EtcdClient(self.config(direct=False)) as client:
                    client.add_member([member.peer_url])
                return
            except DcsUnavailable as exc:
                if "unhealthy cluster" not in str(exc) or time.monotonic() > deadline:
                    raise SandboxError(f"etcd member {member.name} could not be added: {exc}") from None
            time.sleep(1)

    def _client_certificate(self) -> None:
        _ca, cert, key = self.client_files
        if not (cert.exists() and key.exists()):
            issued = self.ca.issue_certificate(common_name="pgcarve-manager", server=False, client=True)
            self.ca.write_server_certificate(MANAGER_CERT, issued)

    def _prepare(self, member: MemberSpec) -> None:
        """The member's directory, certificate and (for a witness) namespace."""
        tls = member.directory / "tls"
        tls.mkdir(parents=True, exist_ok=True)
        issued = self.ca.issue_certificate(common_name=member.name, ip_addresses=[member.address, "127.0.0.1"],
                                           server=True, client=True)
        write_key_and_certificate(tls, "member", issued)
        shutil.copyfile(self.ca.cert_file, tls / "ca.pem")
        (member.directory / "member.json").write_text(member.to_json())
        if member.witness and not netns_exists(member.netns):
            self._witness_netns(member)

    def _witness_netns(self, member: MemberSpec) -> None:
        veth = f"e{member.name[-1]}"  # the wire's side; hosts' are w0, w1, ...
        run_checked(["ip", "netns", "add", member.netns])
        run_checked(["ip", "-n", member.netns, "link", "set", "lo", "up"])
        run_checked(["ip", "-n", member.netns, "link", "add", "uplink", "type", "veth", "peer", "name", veth,
                     "netns", self.wire_netns])
        run_checked(["ip", "-n", self.wire_netns, "link", "set", veth, "master", "wire0", "up"])
        run_checked(["ip", "-n", member.netns, "addr", "add", f"{member.address}/24", "dev", "uplink"])
        run_checked(["ip", "-n", member.netns, "link", "set", "uplink", "up"])
        # Guests on every host reach the witness through their host: answers go back the same way.
        for index in range(MAX_HOSTS):
            run_checked(["ip", "-n", member.netns, "route", "add", f"10.77.{index}.0/24",
                         "via", f"10.76.0.{index + 1}"])

    def _start(self, member: MemberSpec, cluster: Sequence[MemberSpec], new: bool) -> None:
        pid_file, log = member.directory / "etcd.pid", member.directory / "etcd.log"
        pid_file.unlink(missing_ok=True)
        member.record_file.unlink(missing_ok=True)
        args = member_args(member, cluster, f"pgc-{self.tag}", new)
        reaper = member.directory / f"reaper-{time.time_ns()}.json"
        run_checked([sys.executable, str(Path(__file__).with_name("reaper.py")), str(reaper),
                     "ip", "netns", "exec", member.netns, "sh", "-c", _START, "pgcarve-etcd", str(log), str(pid_file),
                     *args])
        deadline = time.monotonic() + 10
        while self._adopt(member, pid_file) is None:
            if time.monotonic() > deadline:
                raise SandboxError(f"etcd member {member.name} did not start in namespace {member.netns}: "
                                   f"{self._log_tail(member)}")
            time.sleep(0.05)
        self._forward(member)

    def _forward(self, member: MemberSpec) -> None:
        self.forwards.ensure(member.forward_name, str(NETNS_DIR / member.netns), f"{member.address}:{CLIENT_PORT}")

    def _adopt(self, member: MemberSpec, pid_file: Path) -> ProcessRecord | None:
        return adopt_daemon(pid_file, "etcd", NETNS_DIR / member.netns, member.record_file)

    def _log_tail(self, member: MemberSpec) -> str:
        log = member.directory / "etcd.log"
        return log.read_text(errors="replace")[-600:] if log.exists() else "(no log)"

    def health(self, timeout_s: float = 2.0) -> ClusterHealth:
        """The cluster as the sandbox sees it through the forwards."""
        with EtcdClient(self.config(direct=False), timeout_s=timeout_s) as client:
            return assess(client.probe())

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> ClusterHealth:
        """Once every member is up and they follow one leader; SandboxError (with logs) if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                health = self.health()
                if health.members and all(m.up for m in health.members) and health.has_quorum:
                    return health
                why = "; ".join(f"{m.name}: {m.detail}" for m in health.members if not m.up) or "no leader yet"
            except PgcarveError as exc:
                why = str(exc)
            if time.monotonic() > deadline:
                tails = "\n".join(f"{m.name}: {self._log_tail(m)[-300:]}" for m in self.members())
                raise SandboxError(f"the sandbox's etcd is not healthy after {timeout_s:.0f} s ({why})\n{tails}")
            time.sleep(0.3)

    # -- a member stopped and started (tests, faults) ------------------------------------------

    def stop_member(self, name: str) -> None:
        member = self.member(name)
        record = self.running(member)
        if record is not None:
            processes.stop(record)

    def start_member(self, name: str) -> None:
        """Start a stopped member again from its data (and its forward, if that went too)."""
        member = self.member(name)
        if self.running(member) is not None:
            self._forward(member)
            return
        if member.witness and not netns_exists(member.netns):  # gone with a reboot: made again
            self._witness_netns(member)
        self._start(member, self.members(), new=False)

    # -- down ----------------------------------------------------------------------------------

    def down(self) -> None:
        """Stop every member by its record, the witnesses' namespaces, and remove the data."""
        # Killed at once, all of them: their data goes with them, and a member left last would
        # otherwise spend seconds trying to hand over its leadership before it exits.
        for member in self.members():
            if (record := self.running(member)) is not None:
                processes.signal_process(record, signal.SIGKILL)
        for member in self.members():
            record = self.running(member)
            if record is not None:
                processes.stop(record)
            for reaper_file in member.directory.glob("reaper-*.json"):
                reaper = processes.running_record(reaper_file)
                if reaper is not None:
                    processes.stop(reaper)
            if member.witness and netns_exists(member.netns):
                stop_namespace_processes(member.netns)
                run_checked(["ip", "netns", "del", member.netns], check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[str]:
        left = [f"namespace {m.netns}" for m in plan_members(self.root, self.tag, []) if netns_exists(m.netns)]
        return left + ([f"directory {self.root}"] if self.root.exists() else [])


def etcdctl(member: MemberSpec, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """`etcdctl ARGS` inside the member's namespace, with the member's own certificate."""
    tls = member.directory / "tls"
    return subprocess.run(["ip", "netns", "exec", member.netns, "etcdctl", f"--endpoints={member.client_url}",
                           f"--cacert={tls / 'ca.pem'}", f"--cert={tls / 'member.pem'}", f"--key={tls / 'member.key'}",
                           *args], capture_output=True, text=True, check=False, timeout=30)
