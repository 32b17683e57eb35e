"""Where instance i lives: its primary's host and CPU slot, its standbys' hosts and slots.

One pure rule, used by the manager (control/provisioning), the Terraform variables (tfvars) and
the benchmarks, so every path pins identically:

* primary hosts are filled in hosts-file order: instance i goes to the first primary host whose
  capacity the instances before it have not used up, and takes slot i - (capacity of the primary
  hosts before it) there;
* standby s (1-based) of instance i goes to standby host (i + s - 2) mod n: an instance's
  standbys are on different hosts, never on its primary's host, and the synchronous role rotates
  across the standby hosts; it takes slot i there;
* the fleet holds as many instances as its primary hosts have slots, limited by each standby
  host's slots when instances have standbys.

Slots come from the planner (plan_host), which never moves an existing slot as the count grows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pgcarve.config import FleetConfig, HostConfig, InstanceSize
from pgcarve.errors import CapacityError, ConfigError
from pgcarve.naming import instance_name, standby_name
from pgcarve.planning.planner import HostPlan, InstanceSlot, PlannerConfig, capacity, plan_host
from pgcarve.planning.topology import HostTopology


def planner_config(size: InstanceSize) -> PlannerConfig:
    """The planner's view of the hosts file's instance size."""
    return PlannerConfig(vcpus_per_instance=size.vcpus, memory_mib_per_instance=size.memory_mib,
                         housekeeping_cpus=size.housekeeping_cpus, hugepages=size.hugepages)


@dataclass(frozen=True)
class Placement:
    """The placement rule over a fleet's hosts, given each host's topology."""

    config: FleetConfig
    topologies: Mapping[str, HostTopology]
    # Each host's capacity, planned once: hosts_for and slot ask for it host after host, for
    # every instance of a scale.
    _capacities: dict[str, int] = field(default_factory=dict, init=False, compare=False, repr=False)
    _full_plans: dict[str, HostPlan] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def planner(self) -> PlannerConfig:
        return planner_config(self.config.instance)

    def host_capacity(self, host: str) -> int:
        """Instance slots on one host."""
        found = self._capacities.get(host)
        if found is None:
            found = self._capacities[host] = capacity(self.topologies[host], self.planner)
        return found

    def capacity(self) -> int:
        """Instances the fleet can hold: primary hosts' slots, limited by the standby hosts'."""
        total = sum(self.host_capacity(h.name) for h in self.config.primary_hosts)
        if self.config.replication.standbys:
            total = min([total] + [self.host_capacity(h.name) for h in self.config.standby_hosts])
        return total

    def first_index(self, host: str) -> int:
        """The fleet-wide index of a primary host's first instance."""
        offset = 0
        for other in self.config.primary_hosts:
            if other.name == host:
                return offset + 1
            offset += self.host_capacity(other.name)
        raise ConfigError(f"host {host} is not a primary host")

    def hosts_for(self, index: int) -> tuple[HostConfig, list[HostConfig]]:
        """Instance `index`'s primary host, and its standbys' hosts in standby order."""
        remaining = index
        primary_host = None
        for host in self.config.primary_hosts:
            cap = self.host_capacity(host.name)
            if remaining <= cap:
                primary_host = host
                break
            remaining -= cap
        if primary_host is None or index < 1:
            raise CapacityError(f"instance {index} exceeds the fleet's capacity of {self.capacity()} instances")
        standby_hosts = self.config.standby_hosts
        chosen = [standby_hosts[(index + s - 2) % len(standby_hosts)]
                  for s in range(1, self.config.replication.standbys + 1)]
        return primary_host, chosen

    def guests(self, index: int) -> list[tuple[HostConfig, str]]:
        """(host, guest name) of instance `index`'s planned guests: its primary, then its standbys
        in standby order (pgc-01 on the primary host, pgc-01-sK on standby host K)."""
        primary_host, standby_hosts = self.hosts_for(index)
        fleet = self.config.fleet
        return [(primary_host, instance_name(fleet, index))] + [
            (host, standby_name(fleet, index, s)) for s, host in enumerate(standby_hosts, start=1)]

    def spares(self, index: int, occupied: set[str]) -> list[tuple[HostConfig, str]]:
        """(host, guest name) on each standby host outside instance `index`'s placement and not in
        `occupied`: where a member of a lost host is built again. A standby host keeps a slot for
        every instance (its slot i is instance i's), and the name is the one the placement rule
        would give standby K there (pgc-01-sK, K above replication.standbys), so a name never
        exists on two hosts."""
        standby_hosts = self.config.standby_hosts
        planned = {h.name for h, _ in self.guests(index)}
        return [(host, standby_name(self.config.fleet, index, (position - index + 1) % len(standby_hosts) + 1))
                for position, host in enumerate(standby_hosts)
                if host.name not in occupied and host.name not in planned]

    def slot(self, host: str, index: int) -> tuple[HostPlan, InstanceSlot]:
        """The CPU slot instance `index` takes on `host` (stable across scaling)."""
        if host in {h.name for h in self.config.primary_hosts}:
            local = index - self.first_index(host) + 1
        else:
            local = index
        if not 1 <= local <= self.host_capacity(host):
            plan = plan_host(self.topologies[host], self.planner, local)  # the planner says why not
            return plan, plan.slots[local - 1]
        # The plan for `local` instances is the full plan's first `local` slots (the planner never
        # moves a slot as the count grows): planned once per host, not once per instance.
        full = self._full_plans.get(host)
        if full is None:
            full = self._full_plans[host] = plan_host(self.topologies[host], self.planner, self.host_capacity(host))
        return replace(full, slots=full.slots[:local]), full.slots[local - 1]

    def check(self, instances: int) -> None:
        """Refuse (CapacityError/ConfigError, naming the limit) a count the hosts cannot hold."""
        if instances < 0:
            raise ConfigError(f"instance count must be >= 0, not {instances}")
        cap = self.capacity()
        if instances > cap:
            # Let the planner word the limit for the first host that runs out.
            for host in (*self.config.primary_hosts, *self.config.standby_hosts):
                plan_host(self.topologies[host.name], self.planner, min(instances, 10**6))
            raise CapacityError(f"the fleet has room for {cap} instances; {instances} requested")
