"""`pgcarve doctor`: what real hosts need, checked before any change.

Every host is connected to and read, never changed: its pool and network are looked up, not
created or started (virt/facts.py), and the KVM probe boots its short-lived guest only from a
guest image already on the host (or, with upload_image, after uploading it as `pgcarve up`
would). Counts are measured against a scale to N instances (default: the fleet's capacity):
addresses in each DHCP range, space in each pool, free hugepages on each NUMA node. Findings
and their statuses are control/doctor_report.py; the network checks control/doctor_network.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pgcarve.config import EtcdConfig, HostConfig
from pgcarve.control.doctor_etcd import etcd_findings, probe_etcd
from pgcarve.control.doctor_network import NetworkChecks, Route, Subnet, lookup_route, subnet_findings
from pgcarve.control.doctor_report import FLEET, NOT_CHECKED, Finding, Status, plural
from pgcarve.control.fleet import Fleet
from pgcarve.dcs.etcd import Probe
from pgcarve.errors import CapacityError, ConfigError, ImageMissing, PgcarveError
from pgcarve.guest.image import LocalImage
from pgcarve.planning.placement import Placement, planner_config
from pgcarve.planning.planner import HUGEPAGE_MIB, HostPlan, plan_host
from pgcarve.planning.topology import HostTopology, format_cpuset
from pgcarve.virt.facts import free_hugepages_2m, kvm_offered, pool_facts
from pgcarve.virt.host import LibvirtHost
from pgcarve.virt.probe import probe_kvm
from pgcarve.virt.storage import BaseImage

# The oldest libvirt pgcarve supports: what Ubuntu 22.04 ships (Debian 12 has 9.0.0).
# The XML pgcarve writes (open networks, serial log files, <cpu check>) and the calls it makes
# (metadata, DHCP leases, free pages) are all older: a supported floor, not a measured limit.
MIN_LIBVIRT = (8, 0, 0)

KvmProbe = Callable[[LibvirtHost, BaseImage], tuple[bool, str]]


@dataclass(frozen=True)
class Target:
    """A scale to `instances`: which instances would have a guest on each host."""

    instances: int
    placement: Placement
    placed: Mapping[str, list[int]]  # host -> indexes of the instances with a guest there


class Doctor:
    """Runs every check on a fleet's hosts and its etcd (`run`). `route`, `probe` and `etcd_probe`
    are seams for tests."""

    def __init__(self, fleet: Fleet, instances: int | None = None, *, upload_image: bool = False,
                 route: Callable[[str], Route] = lookup_route, probe: KvmProbe = probe_kvm,
                 etcd_probe: Callable[[EtcdConfig], Probe] = probe_etcd):
        if instances is not None and instances < 0:
            raise ConfigError(f"instance count must be >= 0, not {instances}")
        self.fleet = fleet
        self.config = fleet.config
        self.instances = instances
        self.upload_image = upload_image
        self.route = route
        self.probe = probe
        self.etcd_probe = etcd_probe

    def run(self) -> list[Finding]:
        """Every finding, the fleet's first, then each host's in hosts-file order."""
        findings: list[Finding] = []
        reachable = []
        for host in self.config.hosts:
            found = self._connect(host)
            findings += found
            if found[0].status == "ok":
                reachable.append(host)
        target, about = self._target()
        findings += about
        subnets: dict[str, tuple[HostConfig, Subnet]] = {}
        network = NetworkChecks(self.config, self.route, target.instances if target else None)
        for host in reachable:
            findings += self._host(host, target, network, subnets)
        findings += subnet_findings(self.config, subnets)
        findings += etcd_findings(self.config.etcd, self.etcd_probe)
        findings.append(Finding(FLEET, "clock", "warn", (
            f"clock skew {NOT_CHECKED}: libvirt has no call that reads a host's clock without a guest agent; keep "
            "every host and this machine synchronised (chrony or systemd-timesyncd; `chronyc tracking` shows the "
            "offset), as logs, incident times and TLS certificates' validity periods assume agreeing clocks")))
        order = {FLEET: -1} | {h.name: i for i, h in enumerate(self.config.hosts)}
        return sorted(findings, key=lambda f: order.get(f.host, len(order)))

    # -- the connection and the plan --------------------------------------------------------

    def _connect(self, host: HostConfig) -> list[Finding]:
        try:
            versions = self.fleet.hosts[host.name].versions()
        except PgcarveError as exc:
            reason = str(exc).split(f"{host.uri}: ", 1)[-1]
            return [Finding(host.name, "connect", "fail", (
                f"cannot connect to libvirt at {host.uri}: {reason}; check that libvirtd runs on {host.name} "
                "and that this machine may log in to it (the ssh key, TLS certificate or socket path of the URI)"))]
        version = versions["libvirt"]
        found = [Finding(host.name, "connect", "ok", f"connected to {host.uri} (host {versions['hostname']}, "
                                                     f"hypervisor version {versions['hypervisor']})")]
        least = ".".join(map(str, MIN_LIBVIRT))
        if tuple(int(part) for part in version.split(".")) < MIN_LIBVIRT:
            found.append(Finding(host.name, "libvirt", "fail", (
                f"libvirt {version} on {host.name} is older than {least}, the oldest pgcarve supports: "
                "upgrade libvirt there (its distribution's current release, or a backport)")))
        else:
            found.append(Finding(host.name, "libvirt", "ok", f"libvirt {version} (pgcarve needs {least} or newer)"))
        return found

    def _target(self) -> tuple[Target | None, list[Finding]]:
        """The scale checked against, or None (with why) when a host's topology is unknown."""
        try:
            placement = self.fleet.placement
            capacity = placement.capacity()
        except PgcarveError as exc:
            return None, [Finding(FLEET, "scale", "warn", (
                f"counts not checked: the plan needs every host's CPUs and memory ({exc}); the DHCP range, "
                "pool space and hugepages of each host are checked against a scale only when every host answers"))]
        wanted = capacity if self.instances is None else self.instances
        if wanted > capacity:
            why = ""
            try:
                placement.check(wanted)
            except PgcarveError as exc:
                why = f" ({exc})"
            finding = Finding(FLEET, "scale", "fail", (
                f"a scale to {wanted} instances would be refused: the fleet has room for {capacity}{why}; "
                "add hosts or make instances smaller"))
        elif capacity == 0:
            finding = Finding(FLEET, "scale", "fail", (
                "the fleet has room for no instance: every scale-up would be refused (the capacity lines say "
                "which host holds none, and why)"))
        else:
            which = "the fleet's capacity" if self.instances is None else f"the fleet has room for {capacity}"
            finding = Finding(FLEET, "scale", "ok", f"counts below are for a scale to {wanted} instances ({which})")
        placed: dict[str, list[int]] = {h.name: [] for h in self.config.hosts}
        for index in range(1, min(wanted, capacity) + 1):
            primary, standbys = placement.hosts_for(index)
            for host in (primary, *standbys):
                placed[host.name].append(index)
        return Target(wanted, placement, placed), [finding]

    # -- one host -----------------------------------------------------------------------------

    def _host(self, host: HostConfig, target: Target | None, network: NetworkChecks,
              subnets: dict[str, tuple[HostConfig, Subnet]]) -> list[Finding]:
        lv = self.fleet.hosts[host.name]
        planned = list(target.placed[host.name]) if target else None
        findings = self._guarded(host, "kvm", lambda: self._kvm(host, lv))
        findings += self._guarded(host, "capacity", lambda: self._layout(host, target, planned or []))
        if target is not None:
            findings += self._guarded(host, "pool", lambda: self._to_start(host, lv, target, planned or []))
        elif self.config.instance.hugepages:  # whether the host has any, at least
            findings += self._guarded(host, "hugepages", lambda: [self._hugepages(host, lv, Counter(), "a scale")])
        findings += self._guarded(host, "network", lambda: network.check(host, lv, planned, subnets))
        return findings

    def _guarded(self, host: HostConfig, check: str, run: Callable[[], list[Finding]]) -> list[Finding]:
        """A check's findings; libvirt failing to answer it is itself a failure (a scale asks the same)."""
        try:
            return run()
        except PgcarveError as exc:
            return [Finding(host.name, check, "fail", f"{check} could not be read on {host.name}: {exc}")]

    def _kvm(self, host: HostConfig, lv: LibvirtHost) -> list[Finding]:
        wanted = self.config.domain_type
        offered = kvm_offered(lv)

        def finding(status: Status, message: str) -> list[Finding]:
            return [Finding(host.name, "kvm", status, message)]

        slower = "many times slower than under KVM"
        if wanted == "qemu":
            hint = "; KVM is offered there: domain_type auto or kvm would use it" if offered else ""
            return finding("warn", f"guests on {host.name} run under emulation (domain_type: qemu), {slower}{hint}")
        if not offered:
            text = (f"libvirt on {host.name} offers no KVM for x86_64 guests: its capabilities list no kvm domain "
                    "(no /dev/kvm, no access to it, or virtualisation off in the firmware)")
            if wanted == "kvm":
                return finding("fail", f"{text}; domain_type is kvm, so no guest would start: load kvm_intel or "
                                       "kvm_amd (with VT-x/AMD-V on in the firmware), or set domain_type: qemu")
            return finding("warn", f"{text}; domain_type auto runs guests there under emulation (qemu), {slower}")
        cached = self.fleet.domain_types.cached(host.name) if wanted == "auto" else None
        if cached is not None:
            kind, why = cached
            if kind == "kvm":
                return finding("ok", f"guests on {host.name} run under KVM: the KVM probe passed earlier ({why})")
            return finding("warn", f"guests on {host.name} run under emulation (qemu), {slower}: the KVM probe failed "
                                   f"earlier ({why}); to probe again, remove {host.uri} from "
                                   f"{self.fleet.paths.probe_cache}")
        image, missing = self._image(host, lv)
        if image is None:
            return finding("warn", f"KVM is offered on {host.name} but not probed: {missing}; `pgcarve up` probes on "
                                   "first use, or `pgcarve doctor --upload-image` uploads the image and probes now")
        booted, why = self.probe(lv, image)
        if booted:
            return finding("ok", f"KVM works on {host.name}: {why}")
        if wanted == "kvm":
            return finding("fail", f"the KVM probe failed on {host.name}: {why}; domain_type is kvm, so guests would "
                                   "not boot: check the host (dmesg, `virt-host-validate`) or set domain_type: auto")
        return finding("warn", f"the KVM probe failed on {host.name}: {why}; domain_type auto runs guests there "
                               f"under emulation (qemu), {slower}")

    def _image(self, host: HostConfig, lv: LibvirtHost) -> tuple[BaseImage | None, str]:
        """The guest image on the host for the probe (uploaded first with upload_image), or why not."""
        try:
            local = LocalImage(self.fleet.paths.image_dir).check()
        except ImageMissing as exc:
            return None, f"the probe boots the guest image's kernel, and {exc}"
        if self.upload_image:
            return self.fleet.images.on(host.name), ""
        found = lv.storage.uploaded_image(local.tag, prepare=False)
        return found, f"the guest image {local.tag} is not on {host.name} yet (the probe boots its kernel there)"

    def _layout(self, host: HostConfig, target: Target | None, planned: list[int]) -> list[Finding]:
        """Capacity, the NUMA layout with the plan's instances on each node, and CPU isolation."""
        topology = self.fleet.topology(host.name)
        size = self.config.instance
        planner = planner_config(size)
        try:
            plan = plan_host(topology, planner, 1)
        except CapacityError as exc:
            plan = plan_host(topology, planner, 0)
            first = Finding(host.name, "capacity", "fail", (
                f"{host.name} cannot hold even one instance: the {exc}; give it more CPUs, memory or hugepages, "
                "or make instance.vcpus or instance.memory_mib smaller"))
        else:
            here = f"; {len(planned)} of them here at a scale to {target.instances}" if target else ""
            first = Finding(host.name, "capacity", "ok", f"room for {plural(plan.capacity, 'instance')} of "
                                                         f"{size.vcpus} vCPU / {size.memory_mib} MiB{here}")
        per_node = Counter(target.placement.slot(host.name, i)[1].numa_node for i in planned) if target else None
        nodes = "; ".join(
            f"node {node.id}: CPUs {format_cpuset(node.cpus) or 'none'}, {node.memory_mib} MiB"
            + (f", {plural(per_node[node.id], 'instance')} planned" if per_node is not None else "")
            for node in topology.nodes)
        numa = Finding(host.name, "numa", "ok", f"{plural(len(topology.nodes), 'NUMA node')}: {nodes}")
        return [first, numa, self._isolation(host, topology, plan)]

    def _isolation(self, host: HostConfig, topology: HostTopology, plan: HostPlan) -> Finding:
        housekeeping = plan.housekeeping_cpus
        if not housekeeping:
            return Finding(host.name, "cpus", "warn", (
                f"isolated CPUs {NOT_CHECKED}: the plan keeps no housekeeping CPUs on this "
                f"{topology.cpu_count}-CPU host, so emulator threads and the host's own work share the guests' "
                "CPUs and there is nothing to isolate; set instance.housekeeping_cpus to keep some"))
        guests = format_cpuset({cpu.id for cpu in topology.cpus} - set(housekeeping))
        return Finding(host.name, "cpus", "warn", (
            f"isolated CPUs {NOT_CHECKED} (it does not show the host's kernel command line): the plan keeps CPUs "
            f"{format_cpuset(housekeeping)} for the host and emulator threads and pins guests among {guests}; "
            f"to keep the host's own work off those, boot {host.name} with isolcpus=managed_irq,domain,{guests} "
            f"nohz_full={guests} (or make them an isolated cgroup v2 cpuset partition), then compare "
            "/sys/devices/system/cpu/isolated there"))

    def _to_start(self, host: HostConfig, lv: LibvirtHost, target: Target, planned: list[int]) -> list[Finding]:
        """What the guests a scale would start here need: pool space and, if asked, hugepages."""
        present = {guest.metadata.index for guest in lv.guests(self.config.fleet)}
        starting = [i for i in planned if i not in present]
        scale = f"a scale to {target.instances}"
        findings = [self._pool(host, lv, len(starting), scale)]
        if self.config.instance.hugepages:
            nodes = Counter(target.placement.slot(host.name, i)[1].numa_node for i in starting)
            findings.append(self._hugepages(host, lv, nodes, scale))
        return findings

    def _pool(self, host: HostConfig, lv: LibvirtHost, starting: int, scale: str) -> Finding:
        reserve = self.config.instance.disk_reserve_mib
        need = starting * reserve
        needs = (f"the {plural(starting, 'guest')} that {scale} starts there need {need} MiB "
                 f"({reserve} MiB each, instance.disk_reserve_mib)")
        facts = pool_facts(lv, host.pool)
        if facts is None:
            return Finding(host.name, "pool", "warn", (
                f"storage pool {host.pool} is not defined on {host.name}: the manager creates it at {host.pool_path} "
                f"on first use (or define it: `virsh pool-define-as {host.pool} dir --target {host.pool_path}`, then "
                f"pool-build, pool-start, pool-autostart); its free space is not known until then, and {needs}"))
        if facts.free_mib is None:
            return Finding(host.name, "pool", "warn", (
                f"storage pool {host.pool} on {host.name} is defined but not running: the manager starts it on "
                f"first use (or `virsh pool-start {host.pool}`); its free space is not known until then, and {needs}"))
        where = f"storage pool {host.pool} ({facts.path}) on {host.name}"
        if facts.free_mib < need:
            return Finding(host.name, "pool", "fail", f"{where} has {facts.free_mib} MiB free: {needs}; free space "
                                                      "there or lower instance.disk_reserve_mib")
        grow_mib = starting * self.config.instance.disk_gib * 1024
        if grow_mib > facts.free_mib:
            return Finding(host.name, "pool", "warn", (
                f"{where} has {facts.free_mib} MiB free, enough to start guests, but their disks may grow to "
                f"{grow_mib // 1024} GiB in all (instance.disk_gib {self.config.instance.disk_gib} each): a guest "
                "whose disk cannot grow stops writing; watch the pool or free space there"))
        return Finding(host.name, "pool", "ok", f"{where}: {facts.free_mib} MiB free; {needs}")

    def _hugepages(self, host: HostConfig, lv: LibvirtHost, starting: Counter[int], scale: str) -> Finding:
        topology = self.fleet.topology(host.name)
        per = -(-self.config.instance.memory_mib // HUGEPAGE_MIB)
        how = ("reserve them at boot (hugepagesz=2M hugepages=N) or per node "
               "(/sys/devices/system/node/nodeN/hugepages/hugepages-2048kB/nr_hugepages), or set instance.hugepages: "
               "false")
        if not any(node.hugepages_2m for node in topology.nodes if node.cpus):
            return Finding(host.name, "hugepages", "fail", (
                f"instance.hugepages is true but {host.name} has no 2 MiB hugepages configured: each guest needs "
                f"{per} on its NUMA node; {how}"))
        free = free_hugepages_2m(lv, [node.id for node in topology.nodes])
        kind = "free"
        if free is None:
            free = {node.id: node.hugepages_2m for node in topology.nodes}
            kind = "configured (libvirt reports no free count)"
        short = [f"node {node} has {free.get(node, 0)} {kind}, its {plural(count, 'guest')} to start need {count * per}"
                 for node, count in sorted(starting.items()) if count * per > free.get(node, 0)]
        if short:
            return Finding(host.name, "hugepages", "fail", (
                f"not enough 2 MiB hugepages on {host.name} for {scale}: {'; '.join(short)} ({per} each for "
                f"instance.memory_mib {self.config.instance.memory_mib}); {how}"))
        counts = ", ".join(f"node {node}: {count}" for node, count in sorted(free.items()))
        return Finding(host.name, "hugepages", "ok", f"2 MiB hugepages {kind}: {counts}; {per} per guest, "
                                                      f"{sum(starting.values())} guest(s) to start here")
