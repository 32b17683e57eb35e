"""The local sandbox: private libvirt hosts for machines that have none configured.

(Faults injected into it on purpose are sandbox/faults.py.)

Each sandbox host is its own network namespace with its own libvirtd and virtlogd, in a mount
namespace where /run, /etc/libvirt, /var/lib/libvirt, /var/log/libvirt and /var/cache/libvirt
are private, so nothing touches the machine's own libvirt. Guests, bridges, dnsmasq and every
10.x address live only inside those namespaces. Hosts are joined by a virtual wire (a bridge in
a namespace of its own, a veth to each host) and route each other's guest networks, so
replication really crosses from one "host" to another. By default pgcarve reaches each libvirtd
through its unix socket (a qemu+unix:// URI with socket=...), and guests through 127.0.0.1
forwards; with `--transport ssh` it reaches them as on real hosts (see sandbox/remote.py). The
unix sockets stay the sandbox's own way in either way (`down`, faults).

Everything started here is recorded under the sandbox directory (PID, start time, boot; see
pgcarve.processes) and stopped by PID, only while the record still names the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pgcarve.processes as processes
from pgcarve.config import FleetConfig, HostConfig, InstanceSize, Replication, write_fleet_config
from pgcarve.errors import SandboxError
from pgcarve.guest.tls import FleetCA
from pgcarve.processes import ProcessRecord
from pgcarve.sandbox.etcd import SandboxEtcd
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.sandbox.libvirt_files import START_DAEMONS, write_libvirt_config
from pgcarve.sandbox.namespaces import (
    NETNS_DIR,
    adopt_daemon,
    netns_exists,
    run_checked,
    stop_namespace_processes,
)
from pgcarve.sandbox.remote import SSHD, TRANSPORTS, ManagerSide, authorize, host_public_key, sshd_config, wire_manager
from pgcarve.sandbox.repository import SandboxRepository
from pgcarve.settings import Paths
from pgcarve.statedir.layout import make_fleet_ca_if_new
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.xml_specs import NetworkSpec

REQUIRED_TOOLS = ("ip", "unshare", "libvirtd", "virtlogd", "qemu-system-x86_64", "dnsmasq", "qemu-img")
GUEST_NET = "10.77.{i}.0/24"
WIRE_PREFIX = "10.76.0."
NETWORK_NAME = "pgcarve"
GUEST_BRIDGE = "pgcbr0"  # the guests' bridge inside each host's namespace
MAX_HOSTS = 8

def machine_cores_per_socket() -> int:
    """Physical cores in this machine's first socket (from sysfs; 1 if it cannot be read)."""
    cores = set()
    for topology in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            if (topology / "physical_package_id").read_text().strip() == "0":
                cores.add((topology / "core_id").read_text().strip())
        except OSError:
            continue
    return len(cores) or 1


@dataclass(frozen=True)
class SandboxHost:
    index: int
    name: str  # h0, h1, ...
    netns: str
    directory: Path
    socket_dir: Path

    @property
    def uri(self) -> str:
        """The sandbox's own way in (its unix socket), whatever the transport."""
        return f"qemu+unix:///system?socket={self.socket_dir}/libvirt-sock"

    @property
    def address(self) -> str:
        """The host's address on the sandbox wire."""
        return f"{WIRE_PREFIX}{self.index + 1}"

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def pid_files(self) -> list[Path]:
        """The daemons' own pid files and pgcarve's records of them."""
        return [self.directory / "pids" / f"{daemon}.{ext}"
                for daemon in ("libvirtd", "virtlogd", "sshd") for ext in ("pid", "json")]


class Sandbox:
    """The sandbox belonging to one pgcarve state directory."""

    def __init__(self, directory: Path):
        self.directory = directory.resolve()
        # Namespace and socket names must be short and unique per state directory.
        self.tag = hashlib.sha256(str(self.directory).encode()).hexdigest()[:6]
        self.socket_root = Path(f"/var/tmp/pgcarve-{self.tag}")
        self.forwards = ForwardRegistry(self.directory / "forwards")
        # etcd's certificates come from the state directory's fleet CA (the sandbox is <state>/sandbox).
        self.etcd = SandboxEtcd(self.directory, self.tag, self.wire_netns, FleetCA(self.directory.parent / "tls"),
                                self.forwards)
        self.repository = SandboxRepository(self.directory, self.tag, self.wire_netns)

    @property
    def wire_netns(self) -> str:
        return f"pgc-{self.tag}-wire"

    @property
    def manager(self) -> ManagerSide:
        """Where the manager runs with `--transport ssh` (see sandbox/remote.py)."""
        return ManagerSide(f"pgc-{self.tag}-mgr", self.directory / "manager", f"{WIRE_PREFIX}254")

    @property
    def transport(self) -> str:
        """How pgcarve reaches this sandbox's hosts: unix (sockets, forwards) or ssh (as on real hosts)."""
        try:
            return (self.directory / "transport").read_text().strip() or "unix"
        except FileNotFoundError:
            return "unix"

    def manager_command(self, args: list[str]) -> list[str]:
        """`args` run where the manager runs: in its namespace with `--transport ssh`, else here."""
        return self.manager.command(args) if self.transport == "ssh" else list(args)

    def backdoor(self, config: FleetConfig) -> FleetConfig:
        """`config` with every sandbox host reached through its unix socket and forwards, for the
        sandbox's own work from this machine (`down`, faults) whatever the transport; its etcd
        members too (under Patroni `down` reads and removes keys), by their 127.0.0.1 forwards:
        their wire addresses mean nothing here, and a request to them would leave for the real
        network."""
        ours = {h.name: {"uri": h.uri, "reach": "sandbox", "netns": h.netns} for h in self.hosts()}
        etcd = config.etcd
        if etcd is not None and set(etcd.endpoints) == {m.client_url for m in self.etcd.members()}:
            local = self.etcd.config(direct=False)
            etcd = etcd.model_copy(update={"endpoints": local.endpoints, "guest_endpoints": local.guest_endpoints})
        return config.model_copy(update={"hosts": [host.model_copy(update=ours.get(host.name, {}))
                                                   for host in config.hosts], "etcd": etcd})

    def host(self, index: int) -> SandboxHost:
        return SandboxHost(
            index=index,
            name=f"h{index}",
            netns=f"pgc-{self.tag}-h{index}",
            directory=self.directory / f"h{index}",
            socket_dir=self.socket_root / f"h{index}",
        )

    def hosts(self) -> list[SandboxHost]:
        found = []
        for index in range(MAX_HOSTS):
            host = self.host(index)
            if host.directory.exists():
                found.append(host)
        return found

    def is_up(self) -> bool:
        hosts = self.hosts()
        return bool(hosts) and all(self.daemon(h, "libvirtd") for h in hosts)

    def daemon(self, host: SandboxHost, daemon: str) -> ProcessRecord | None:
        """The running daemon (libvirtd or virtlogd) of a sandbox host, or None.

        The daemons write their pid files themselves, so pgcarve keeps its own record beside
        each (pids/<daemon>.json: PID, start time, boot), made when it first reads the pid file
        and has checked that the PID is that daemon inside this host's network namespace.
        """
        record = processes.running_record(host.directory / "pids" / f"{daemon}.json")
        return record if record is not None else self._adopt_daemon(host, daemon)

    def _adopt_daemon(self, host: SandboxHost, daemon: str) -> ProcessRecord | None:
        pids = host.directory / "pids"
        return adopt_daemon(pids / f"{daemon}.pid", daemon, host.netns_path, pids / f"{daemon}.json")

    def record_daemons(self, host: SandboxHost, daemons: tuple[str, ...]) -> None:
        """Record daemons just started (their pid files are fresh now); SandboxError if a pid
        file does not name its daemon in the host's namespace."""
        for daemon in daemons:
            (host.directory / "pids" / f"{daemon}.json").unlink(missing_ok=True)
            deadline = time.monotonic() + 10
            while self._adopt_daemon(host, daemon) is None:
                if time.monotonic() > deadline:
                    raise SandboxError(f"{daemon} of sandbox host {host.name} started, but its pid file "
                                       f"{host.directory / 'pids' / (daemon + '.pid')} does not name a {daemon} in "
                                       f"namespace {host.netns}; see {host.directory / 'log'}")
                time.sleep(0.1)

    # -- up ----------------------------------------------------------------------------------

    def up(self, hosts: int = 1, size: InstanceSize | None = None,
           progress: Callable[[str], None] = lambda _m: None, transport: str = "unix") -> FleetConfig:
        """Start `hosts` sandbox hosts (idempotent) and write the sandbox's hosts file."""
        if not 1 <= hosts <= MAX_HOSTS:
            raise SandboxError(f"the sandbox supports 1 to {MAX_HOSTS} hosts; {hosts} requested")
        if transport not in TRANSPORTS:
            raise SandboxError(f"unknown sandbox transport {transport!r}: use one of {', '.join(TRANSPORTS)}")
        if self.hosts() and self.transport != transport:
            raise SandboxError(f"the sandbox in {self.directory} is up with transport {self.transport}; "
                               "run `pgcarve sandbox down` first to change it")
        if transport == "ssh" and not SSHD.exists():
            raise SandboxError(f"--transport ssh needs {SSHD}: run `make deps` (installs openssh-server)")
        if os.geteuid() != 0:
            raise SandboxError("the sandbox needs root (network namespaces, libvirtd)")
        missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
        if missing:
            raise SandboxError(f"the sandbox needs {', '.join(missing)}: run `make deps` (installs Debian packages)")
        existing = self.hosts()
        if len(existing) > hosts:
            raise SandboxError(
                f"a sandbox with {len(existing)} host(s) is already up in {self.directory}; "
                "run `pgcarve sandbox down` first to change the number of hosts"
            )
        if not existing:  # a new sandbox runs no guest yet: its etcd may get a new fleet's CA
            made = make_fleet_ca_if_new(Paths(self.directory.parent))
            if made:
                progress(f"made {made}")
        self._wire_up(progress)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "transport").write_text(transport + "\n")
        if transport == "ssh":
            self.manager.ensure_key()
        for index in range(hosts):
            self._host_up(self.host(index), hosts, progress)
        if transport == "ssh":
            progress(f"manager namespace {self.manager.netns} on {self.manager.address}, hosts over ssh")
            self.manager.write_client_files({h.address: host_public_key(h.directory) for h in self.hosts()})
            wire_manager(self.manager, self.wire_netns,
                         {GUEST_NET.format(i=h.index): h.address for h in self.hosts()}, run_checked)
        self.etcd.up([(h.name, h.netns, h.address) for h in self.hosts()], progress)
        if SSHD.exists():
            progress(f"backup repository host (SFTP) in namespace {self.repository.netns}")
            self.repository.up()
        config = self.fleet_config(hosts, size)
        write_fleet_config(config, self.directory / "hosts.yaml")
        return config

    def fleet_config(self, hosts: int, size: InstanceSize | None = None) -> FleetConfig:
        # The sandbox hosts share this machine's cores. Standby hosts lay out their slots from
        # half-way along, so an instance's standbys do not run on its primary's core: under
        # emulation, one instance's three guests on one core left the other idle and made every
        # boot, clone and repair take about twice as long.
        standby_offset = machine_cores_per_socket() // 2
        ssh = self.transport == "ssh"  # then as on real hosts: ssh, and guests by their addresses
        host_configs = [
            HostConfig(
                name=h.name, uri=self.manager.host_uri(h.address) if ssh else h.uri,
                role="primary" if h.index == 0 else "standby",
                pool="pgcarve", pool_path="/var/lib/libvirt/pgcarve", network=NETWORK_NAME,
                reach="direct" if ssh else "sandbox", netns=None if ssh else h.netns,
                core_offset=0 if h.index == 0 else standby_offset,
            )
            for h in (self.host(i) for i in range(hosts))
        ]
        standbys = min(2, hosts - 1)
        return FleetConfig(
            fleet="pgc",
            domain_type="auto",
            instance=size or InstanceSize(vcpus=1, memory_mib=768, housekeeping_cpus=None, hugepages=False, clusters=1,
                                          disk_gib=8, disk_reserve_mib=1024),
            replication=Replication(standbys=standbys, sync_mode="FIRST", sync_count=1,
                                    synchronous_commit="remote_write", retire_catch_up_s=120),
            allowed_cidrs=["10.77.0.0/16", "10.76.0.0/24"],
            etcd=self.etcd.config(direct=ssh) if self.etcd.members() else None,
            backup=self.repository.config() if self.repository.running() is not None else None,
            hosts=host_configs,
        )

    def _wire_up(self, progress: Callable[[str], None]) -> None:
        if netns_exists(self.wire_netns):
            return
        progress(f"creating the sandbox wire (namespace {self.wire_netns})")
        run_checked(["ip", "netns", "add", self.wire_netns])
        run_checked(["ip", "-n", self.wire_netns, "link", "set", "lo", "up"])
        run_checked(["ip", "-n", self.wire_netns, "link", "add", "wire0", "type", "bridge"])
        run_checked(["ip", "-n", self.wire_netns, "link", "set", "wire0", "up"])

    def _host_up(self, host: SandboxHost, total: int, progress: Callable[[str], None]) -> None:
        if self.daemon(host, "libvirtd"):
            return
        progress(f"starting sandbox host {host.name} (namespace {host.netns})")
        for sub in ("etc", "lib", "log/qemu", "cache", "pids"):
            (host.directory / sub).mkdir(parents=True, exist_ok=True)
        host.socket_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_libvirt_config(host.directory, host.socket_dir)
        if not netns_exists(host.netns):
            run_checked(["ip", "netns", "add", host.netns])
            run_checked(["ip", "-n", host.netns, "link", "set", "lo", "up"])
            # The host's uplink to the wire, and routes to the other hosts' guest networks.
            run_checked(["ip", "-n", host.netns, "link", "add", "uplink", "type", "veth",
                  "peer", "name", f"w{host.index}", "netns", self.wire_netns])
            run_checked(["ip", "-n", self.wire_netns, "link", "set", f"w{host.index}", "master", "wire0", "up"])
            run_checked(["ip", "-n", host.netns, "addr", "add", f"{WIRE_PREFIX}{host.index + 1}/24", "dev", "uplink"])
            run_checked(["ip", "-n", host.netns, "link", "set", "uplink", "up"])
            run_checked(["ip", "netns", "exec", host.netns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            for other in range(MAX_HOSTS):
                if other != host.index:
                    run_checked(["ip", "-n", host.netns, "route", "add", GUEST_NET.format(i=other),
                          "via", f"{WIRE_PREFIX}{other + 1}"])
        for pid_file in host.pid_files:
            pid_file.unlink(missing_ok=True)
        sshd = ""
        if self.transport == "ssh":
            sshd = str(sshd_config(host.directory, host.address))
            authorize(host.directory, self.manager.key)
        self.run_reaped(host, ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation", "private",
                                "sh", "-c", START_DAEMONS, "pgcarve-sandbox", str(host.directory),
                                str(host.socket_dir), sshd])
        lv = self.wait_libvirtd(host)
        self.record_daemons(host, ("virtlogd", "libvirtd", "sshd") if sshd else ("virtlogd", "libvirtd"))
        progress(f"{host.name}: network {NETWORK_NAME} 10.77.{host.index}.0/24 and storage pool")
        lv.ensure_network(NetworkSpec(NETWORK_NAME, GUEST_BRIDGE, f"10.77.{host.index}.1", 24,
                                      f"10.77.{host.index}.10", f"10.77.{host.index}.250"))
        lv.storage.ensure_pool()
        lv.close()

    def revive(self, host: SandboxHost) -> None:
        """Start a stopped host's daemons again (its namespace, disks and definitions kept)."""
        if not netns_exists(host.netns):
            raise SandboxError(f"sandbox host {host.name} has no namespace any more: start the sandbox again "
                               "(`pgcarve sandbox up`)")
        self._host_up(host, len(self.hosts()), lambda _m: None)
        if any(m.name == host.name for m in self.etcd.members()):
            self.etcd.start_member(host.name)

    def run_reaped(self, host: SandboxHost, args: list[str]) -> None:
        """Run a command that starts daemons, under a reaper of their orphans (see reaper.py).
        The reaper records itself (PID, start time, boot) in its record file."""
        record_file = host.directory / "pids" / f"reaper-{time.time_ns()}.json"
        run_checked([sys.executable, str(Path(__file__).with_name("reaper.py")), str(record_file), *args])

    def _reapers(self, host: SandboxHost) -> list[ProcessRecord]:
        return [record for record_file in (host.directory / "pids").glob("reaper-*.json")
                if (record := processes.running_record(record_file)) is not None]

    # -- inside a host ------------------------------------------------------------------------

    def host_named(self, name: str) -> SandboxHost:
        """A running sandbox host by name (h0, h1, ...), or SandboxError listing the names."""
        for host in self.hosts():
            if host.name == name:
                return host
        names = ", ".join(h.name for h in self.hosts()) or "none"
        raise SandboxError(f"no sandbox host named {name!r} (hosts: {names})")

    def anchor_pid(self, host: SandboxHost) -> int:
        """A process inside the host's namespaces: virtlogd lives as long as they do."""
        anchor = self.daemon(host, "virtlogd")
        if anchor is None:
            raise SandboxError(f"sandbox host {host.name} is not running (no virtlogd)")
        return anchor.pid

    def enter(self, host: SandboxHost) -> list[str]:
        """The command prefix that runs a command inside the host's network and mount namespaces."""
        return ["nsenter", "-t", str(self.anchor_pid(host)), "-m", "-n", "--"]

    def wait_libvirtd(self, host: SandboxHost, timeout_s: float = 30) -> LibvirtHost:
        """A connection to the host's libvirtd once it answers (started moments ago)."""
        lv = LibvirtHost(host.name, host.uri)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                lv.ping()
                return lv
            except Exception as exc:
                if time.monotonic() > deadline:
                    log = host.directory / "log" / "libvirtd.log"
                    tail = log.read_text()[-800:] if log.exists() else ""
                    raise SandboxError(f"libvirtd for {host.name} did not answer in {timeout_s:.0f} s: "
                                       f"{exc}\n{tail}") from None
                time.sleep(0.2)

    # -- down --------------------------------------------------------------------------------

    def down(self, progress: Callable[[str], None] = lambda _m: None, keep_logs: Path | None = None) -> None:
        """Stop every guest, daemon, forward and namespace of this sandbox, by PID. With
        `keep_logs`, the guests' consoles (Patroni writes its log there too), libvirt's and etcd's
        logs are copied there first: the sandbox's own directories go with it."""
        if keep_logs is not None:
            self.copy_logs(keep_logs)
        self.forwards.remove_all()
        self.etcd.down()
        self.repository.down()
        for host in self.hosts():
            progress(f"stopping sandbox host {host.name}")
            if self.daemon(host, "libvirtd"):
                lv = LibvirtHost(host.name, host.uri)
                with contextlib.suppress(Exception):
                    lv.power_off_everything()
                lv.close()
            for daemon in ("libvirtd", "virtlogd"):
                record = self.daemon(host, daemon)
                if record is not None:
                    processes.stop(record)
            if netns_exists(host.netns):
                stop_namespace_processes(host.netns)
                run_checked(["ip", "netns", "del", host.netns], check=False)
            for reaper in self._reapers(host):  # they leave once their daemons are gone
                processes.stop(reaper)
            shutil.rmtree(host.directory, ignore_errors=True)
            shutil.rmtree(host.socket_dir, ignore_errors=True)
        if netns_exists(self.manager.netns):
            progress("stopping the manager namespace")
            stop_namespace_processes(self.manager.netns)
            run_checked(["ip", "netns", "del", self.manager.netns], check=False)
        shutil.rmtree(self.manager.directory, ignore_errors=True)
        (self.directory / "transport").unlink(missing_ok=True)
        if netns_exists(self.wire_netns):
            run_checked(["ip", "netns", "del", self.wire_netns], check=False)
        shutil.rmtree(self.socket_root, ignore_errors=True)
        shutil.rmtree(self.directory / "forwards", ignore_errors=True)
        (self.directory / "hosts.yaml").unlink(missing_ok=True)

    def copy_logs(self, to: Path) -> None:
        """Every host's libvirt log directory (qemu/<guest>.log, <guest>-console.log) and every etcd
        member's log, under `to`/<host or member>/."""
        for host in self.hosts():
            if (host.directory / "log").is_dir():
                shutil.copytree(host.directory / "log", to / host.name, dirs_exist_ok=True)
        for member in self.etcd.members():
            if (log := member.directory / "etcd.log").exists():
                (to / f"etcd-{member.name}").mkdir(parents=True, exist_ok=True)
                shutil.copy2(log, to / f"etcd-{member.name}" / "etcd.log")

    def leftovers(self) -> list[str]:
        """What of this sandbox still exists (empty when down left nothing behind)."""
        left = []
        for index in range(MAX_HOSTS):
            host = self.host(index)
            if netns_exists(host.netns):
                left.append(f"namespace {host.netns}")
            if host.directory.exists():
                left.append(f"directory {host.directory}")
        for netns in (self.wire_netns, self.manager.netns):
            if netns_exists(netns):
                left.append(f"namespace {netns}")
        if self.socket_root.exists():
            left.append(f"directory {self.socket_root}")
        return left + self.etcd.leftovers() + self.repository.leftovers()
