"""The fleet: every pgcarve guest on every configured host, observed from libvirt.

The fleet never remembers guests itself: `observe()` reads them back from libvirt's metadata
each time, so a restarted manager sees exactly what exists. It holds what the doers share: the
hosts, the placement rule, the credentials (the fleet's and each instance's), the fleet CA, the
image uploads, the instance locks. Creating and
removing instances is control/provisioning.py; deciding what to do is the scaler and supervisor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pgcarve.config import FleetConfig, HostConfig
from pgcarve.control.locks import InstanceLocks, PlannedStops
from pgcarve.control.patroni_roles import PatroniClusters
from pgcarve.control.roles_guard import configured_roles, mismatch
from pgcarve.control.sync_record import SyncRecord, SyncRecords
from pgcarve.errors import ConfigError, GuestNotReady, HostUnreachable, NotFound
from pgcarve.guest.credentials import Credentials, InstanceSecrets, InstanceSecretStore, load_credentials
from pgcarve.guest.image import HostImages
from pgcarve.guest.probe import DomainTypes
from pgcarve.guest.tls import FleetCA
from pgcarve.naming import guest_of, index_of, instance_name
from pgcarve.planning.placement import Placement
from pgcarve.planning.topology import HostTopology, parse_capabilities, with_cores_rotated
from pgcarve.postgres import conninfo, session
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.settings import Paths
from pgcarve.virt.host import GuestInfo, LibvirtHost

POSTGRES_PORT = 5432  # every guest's own cluster; further clusters (instance.clusters) listen above it

Progress = Callable[[str, str, float], None]  # (guest name, what is happening, fraction done)


def no_progress(_name: str, _step: str, _fraction: float) -> None:
    pass


@dataclass(frozen=True)
class Guest:
    """One guest as the fleet sees it: libvirt's view plus how to reach it."""

    info: GuestInfo
    address: str | None  # inside the guest network
    endpoint: tuple[str, int] | None  # how this machine reaches PostgreSQL in it

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def host_cpus(self) -> tuple[int, ...]:
        return tuple(sorted({c for row in self.info.vcpu_pins for c in row}))


@dataclass(frozen=True)
class Instance:
    """A primary and its standbys (an immutable snapshot).

    ``stale`` are guests whose metadata still says primary while another is the instance's
    recorded primary: a primary fenced or lost in a failover, to become a standby again (or go).
    ``roles_mismatch``: why pgcarve does not act on it, when its guests were made under another
    decider of roles than the hosts file's (control/roles_guard.py); None when they were not.
    """

    index: int
    name: str
    primary: Guest | None
    standbys: tuple[Guest, ...]
    stale: tuple[Guest, ...] = ()
    roles_mismatch: str | None = None

    @property
    def guests(self) -> tuple[Guest, ...]:
        return (*((self.primary,) if self.primary else ()), *self.standbys, *self.stale)


def _recorded_primary(members: list[GuestInfo], claimants: list[GuestInfo],
                      record: SyncRecord | None) -> GuestInfo | None:
    """The instance's primary: the member its synchronous-set record names (a failover writes the
    record before it promotes or changes metadata). Without a record (an instance from before
    records, or built by Terraform), the only or first guest whose metadata says primary."""
    if record is None:
        return claimants[0] if claimants else None
    return next((g for g in members if g.name == record.primary), None)


class Fleet:
    """Hosts from the hosts file, connected lazily, and the guests on them."""

    def __init__(self, config: FleetConfig, paths: Paths, boot_timeout_s: float = 600.0,
                 hosts: Mapping[str, LibvirtHost] | None = None):
        """`hosts`, by host name, replaces the connections built from the config (one per host in
        it): a seam for stand-ins such as the benchmarks' test-driver hosts."""
        self.config = config
        self.paths = paths
        self.boot_timeout_s = boot_timeout_s
        if hosts is None:
            hosts = {h.name: LibvirtHost(h.name, h.uri, h.pool, h.pool_path) for h in config.hosts}
        elif set(hosts) != {h.name for h in config.hosts}:
            raise ConfigError(f"hosts {sorted(hosts)} are not the configured hosts {[h.name for h in config.hosts]}")
        self.hosts = dict(hosts)
        # The fencing check of a manager among several (control/leadership.py), set by the service;
        # None for a manager alone. Every host change and every admin session on a guest goes through it.
        self.fence: Callable[[str], object] | None = None
        for libvirt_host in self.hosts.values():
            libvirt_host.fence = self.check_fence
        self.forwards = ForwardRegistry(paths.sandbox_dir / "forwards")
        self.images = HostImages(self.hosts, paths.image_dir)
        self.domain_types = DomainTypes(config, self.hosts, self.images, paths.probe_cache)
        self.locks = InstanceLocks()
        self.planned_stops = PlannedStops()
        self.sync_records = SyncRecords(paths.state_dir / "sync")
        # replication.roles: patroni: the instances' leaders are Patroni's, read from etcd.
        self.patroni = (PatroniClusters(config.etcd)
                        if config.replication.roles == "patroni" and config.etcd is not None else None)
        self.secrets = InstanceSecretStore(paths.instance_secrets_dir)
        self.ca = FleetCA(paths.tls_dir)
        self._credentials: Credentials | None = None
        self._client_tls: session.ClientTls | None = None
        self._topologies: dict[str, HostTopology] = {}
        self._placement: Placement | None = None
        self._last_seen: dict[str, list[GuestInfo]] = {}
        self._unreachable: dict[str, tuple[float, str]] = {}
        self._answered_again_at = float("-inf")
        self._last_reach: dict[str, tuple[str | None, tuple[str, int] | None]] = {}
        self._guard = threading.Lock()

    # -- facts -------------------------------------------------------------------------------

    @property
    def credentials(self) -> Credentials:
        with self._guard:
            if self._credentials is None:
                self._credentials = load_credentials(self.paths.secrets_file)
            return self._credentials

    def instance_secrets(self, instance: str) -> InstanceSecrets:
        """An instance's own passwords (NotFound if it has none: made before they existed)."""
        return self.secrets.load(instance)

    @property
    def client_tls(self) -> session.ClientTls:
        """How pgcarve's clients verify guests: the fleet CA's certificate (StateMissing without it)."""
        with self._guard:
            if self._client_tls is None:
                self.ca.load()
                self._client_tls = session.ClientTls(root_cert=str(self.ca.cert_file))
            return self._client_tls

    def topology(self, host: str) -> HostTopology:
        """The host's CPUs and NUMA layout. Kept in the state directory too: a manager started
        while a host is lost still knows where that host's instances were placed."""
        if host not in self._topologies:
            kept = self.paths.state_dir / "topology" / f"{host}.xml"
            try:
                xml = self.hosts[host].capabilities()
            except HostUnreachable:
                if not kept.exists():
                    raise
                xml = kept.read_text()
            else:
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(xml)
            self._topologies[host] = with_cores_rotated(parse_capabilities(xml), self.config.host(host).core_offset)
        return self._topologies[host]

    @property
    def placement(self) -> Placement:
        """Where each instance lives (reads every host's topology once; then kept while the
        config it was made from is the fleet's, as the topologies are)."""
        with self._guard:
            kept = self._placement
        if kept is None or kept.config is not self.config:
            kept = Placement(self.config, {h.name: self.topology(h.name) for h in self.config.hosts})
            with self._guard:
                self._placement = kept
        return kept

    # -- observing ---------------------------------------------------------------------------

    def guests(self, named: Callable[[str], bool] | None = None) -> list[GuestInfo]:
        """Every guest of this fleet (with `named`: those whose name it accepts, read alone). A
        host whose libvirtd does not answer contributes the guests last seen on it, in state
        "unreachable" (see unreachable_hosts())."""
        found: list[GuestInfo] = []
        for name, host in self.hosts.items():
            try:
                listed = host.guests(self.config.fleet, named)
            except HostUnreachable as exc:
                with self._guard:
                    self._unreachable.setdefault(name, (time.time(), str(exc)))
                    listed = [replace(g, state="unreachable") for g in self._last_seen.get(name, [])
                              if named is None or named(g.name)]
            else:
                with self._guard:
                    if named is None:
                        self._last_seen[name] = listed
                    else:  # a partial listing replaces only what it read
                        self._last_seen[name] = sorted(
                            [g for g in self._last_seen.get(name, []) if not named(g.name)] + listed,
                            key=lambda g: g.name)
                    if self._unreachable.pop(name, None) is not None:
                        self._answered_again_at = time.monotonic()
            found.extend(listed)
        return found

    @property
    def host_answered_again_at(self) -> float:
        """When (monotonic) a host that did not answer last answered again; -inf if none has."""
        with self._guard:
            return self._answered_again_at

    def unreachable_hosts(self) -> dict[str, tuple[float, str]]:
        """Hosts whose libvirtd did not answer at the last listing: since when (wall clock), and why."""
        with self._guard:
            return dict(self._unreachable)

    def lost_hosts(self) -> list[str]:
        """Hosts that have not answered for recovery.host_timeout_s: under Patroni their members
        are built again elsewhere (control/recovery.py)."""
        timeout = self.config.recovery.host_timeout_s
        now = time.time()
        return sorted(h for h, (since, _why) in self.unreachable_hosts().items() if now - since >= timeout)

    def observe(self, with_endpoints: bool = True, guests: Sequence[GuestInfo] | None = None) -> list[Instance]:
        """Every instance, rebuilt from libvirt metadata on every host (sorted by index); from
        `guests` when given (a listing just made by guests(), so that one decision reads libvirt
        once)."""
        by_index: dict[int, list[GuestInfo]] = {}
        for info in self.guests() if guests is None else guests:
            by_index.setdefault(info.metadata.index, []).append(info)
        return [self._assemble(index, by_index[index], with_endpoints) for index in sorted(by_index)]

    def absent_standbys(self, inst: Instance) -> list[str]:
        """"<guest> on <host>" for each standby the placement gives `inst` that has no guest, while
        it has fewer standbys than configured (a standby host Terraform has not applied yet, or
        whose guest was destroyed)."""
        if len(inst.standbys) + len(inst.stale) >= self.config.replication.standbys:
            return []
        present = {g.name for g in inst.guests}
        return [f"{name} on {host.name}" for host, name in self.placement.guests(inst.index)[1:] if name not in present]

    def instance_at(self, index: int, with_endpoints: bool = True) -> Instance | None:
        """Instance `index` as libvirt shows it now, if it exists. Only its own guests are read
        (naming.guest_of: by their names, then by their metadata), so the cost does not grow
        with the fleet's other instances."""
        name = instance_name(self.config.fleet, index)
        members = [info for info in self.guests(named=lambda guest: guest_of(name, guest))
                   if info.metadata.index == index]
        return self._assemble(index, members, with_endpoints) if members else None

    def instance_on(self, index: int, guests: Sequence[tuple[str, str]]) -> Instance:
        """Instance `index` made of the guests named, each read from libvirt on its host
        ((host, guest name) pairs): for a doer that has just built them and knows where, with no
        listing at all. NotFound if one of them is not there."""
        return self._assemble(index, [self.hosts[host].guest(name) for host, name in guests])

    def _assemble(self, index: int, members: list[GuestInfo], with_endpoints: bool = True) -> Instance:
        name = instance_name(self.config.fleet, index)
        mismatched = mismatch(name, ((g.name, g.metadata.roles) for g in members), configured_roles(self.config))
        if self.patroni is not None and mismatched is None:
            # Patroni's leader key is the one authority; a guest's metadata role is only the one
            # it was made with. (An instance made under the manager's roles has no key: it is
            # shown as its metadata and sync record say, and left alone.)
            leader = self.patroni.leader(name)
            primary = next((g for g in members if g.name == leader), None)
            stale: list[GuestInfo] = []
            standbys = sorted((g for g in members if g is not primary), key=lambda g: g.metadata.standby or 0)
        else:
            primaries = [g for g in members if g.metadata.role == "primary"]
            primary = _recorded_primary(members, primaries, self.sync_records.get(name))
            stale = [g for g in primaries if g is not primary]
            standbys = sorted((g for g in members if g.metadata.role == "standby" and g is not primary),
                              key=lambda g: g.metadata.standby)
        return Instance(
            index=index,
            name=name,
            primary=self.reach(primary, with_endpoints) if primary else None,
            standbys=tuple(self.reach(g, with_endpoints) for g in standbys),
            stale=tuple(self.reach(g, with_endpoints) for g in stale),
            roles_mismatch=mismatched,
        )

    def instance(self, name: str, with_endpoints: bool = True) -> Instance:
        """Instance `name` as libvirt shows it now (only its own guests are read: instance_at)."""
        index = index_of(self.config.fleet, name)
        found = self.instance_at(index, with_endpoints) if index is not None else None
        if found is None:
            raise NotFound(f"no instance named {name!r}")
        return found

    def reach(self, info: GuestInfo, with_endpoint: bool = True) -> Guest:
        """The guest with its address and this machine's way to its PostgreSQL, when running. A
        guest on a host whose libvirtd does not answer keeps the address last seen: its
        PostgreSQL may well still serve (only libvirtd down), which is worth asking before
        calling the host lost."""
        if not with_endpoint or info.state not in ("running", "unreachable"):
            return Guest(info=info, address=None, endpoint=None)
        if info.state == "unreachable":
            with self._guard:
                address, endpoint = self._last_reach.get(info.name, (None, None))
            return Guest(info=info, address=address, endpoint=endpoint)
        host = self.config.host(info.host)
        address = self.hosts[info.host].guest_address(info.name, host.network, info.mac)
        endpoint = self._endpoint(host, info.name, address)
        with self._guard:
            self._last_reach[info.name] = (address, endpoint)
        return Guest(info=info, address=address, endpoint=endpoint)

    def last_address(self, info: GuestInfo) -> str | None:
        """The guest's address from its newest DHCP lease, running or not: a stopped guest
        started again gets the same one while its lease lasts. On a host that does not answer:
        the address last seen, if any."""
        host = self.config.host(info.host)
        try:
            return self.hosts[info.host].guest_address(info.name, host.network, info.mac)
        except HostUnreachable:
            with self._guard:
                return self._last_reach.get(info.name, (None, None))[0]

    def endpoint_at(self, guest: Guest, port: int) -> tuple[str, int] | None:
        """How this machine reaches the PostgreSQL listening on `port` in a running guest: the
        further clusters of a guest with instance.clusters > 1 (ports 5433 and up)."""
        if guest.address is None:
            return None
        return self._endpoint(self.config.host(guest.info.host), guest.name, guest.address, port)

    def _endpoint(self, host: HostConfig, name: str, address: str | None,
                  port: int = POSTGRES_PORT) -> tuple[str, int] | None:
        if address is None:
            return None
        if host.reach == "direct":
            return address, port
        if host.netns is None:
            raise ConfigError(f"host {host.name}: reach: sandbox needs netns")
        # One forward per guest and port; removing the guest's forward removes them all (sandbox/forward.py).
        key = name if port == POSTGRES_PORT else f"{name}.p{port}"
        fwd = self.forwards.ensure(key, f"/run/netns/{host.netns}", f"{address}:{port}")
        return "127.0.0.1", fwd.port

    def dsn(self, endpoint: tuple[str, int], with_password: bool = False) -> str:
        """The admin's URI for one guest, verifying its certificate with the fleet CA."""
        password = self.credentials.admin_password if with_password else None
        return conninfo.uri(session.ADMIN_USER, session.CLIENT_DATABASE, [endpoint], self.client_tls, password)

    def connect(self, guest: Guest, timeout_s: float = 5.0,
                database: str = session.MANAGER_DATABASE) -> session.Connection:
        """An autocommit admin session on the guest's PostgreSQL (postgres/session.py)."""
        if guest.endpoint is None:
            raise GuestNotReady(f"{guest.name} has no address yet")
        self.check_fence(f"a session on {guest.name}")
        host, port = guest.endpoint
        return session.connect(host, port, self.credentials.admin_password, database, timeout_s, tls=self.client_tls)

    def check_fence(self, what: str) -> None:
        """Raise NotLeader if this manager may not act now (see `fence`)."""
        if self.fence is not None:
            self.fence(what)

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
