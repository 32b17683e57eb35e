"""Terraform variables for one host: the guests the manager would create there.

`pgcarve plan --host NAME --instances N --format tfvars` prints them as JSON, to be saved as a
`.tfvars.json` file for the module in terraform/ (JSON, not HCL: every value, seeds included,
is emitted by the json module, so no string can need HCL escaping). The layout is the manager's
own: each guest gets the domain the manager would define (control/provisioning.py's
domain_spec: the placement's CPU slot and NUMA node, the MAC, the metadata) and the manager's own
seed, rendered with the fleet's credentials, so the manager lists, reaches and can log in to
every guest Terraform creates.

On a primary host these are its primaries; on a standby host, its standbys of the fleet's
instances 1..N. No manager step runs between the applies, so what the manager would learn at
run time is planned here instead: every guest has a reserved address on its host's network
(`reserved_address`), a primary's seed names its synchronous standbys and lets the instance's
other guests replicate, and a standby's seed names its primary's address and has it make its
own replication slot as it clones.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pgcarve.config import HostConfig
from pgcarve.control.fleet import Fleet
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.roles_guard import configured_roles
from pgcarve.control.sync import initial_record, names_for
from pgcarve.errors import ConfigError
from pgcarve.guest.image import LocalImage
from pgcarve.guest.seed import GuestSeed
from pgcarve.virt.domain_xml import DomainSpec, InstanceMetadata
from pgcarve.virt.storage import BaseImage

DEFAULT_CMDLINE: str = DomainSpec.cmdline  # the dataclass field's default: what the manager boots with


def image_variable(image_dir: Path) -> dict[str, str]:
    """The guest image's files (absolute paths on this machine) and its tag."""
    image = LocalImage(image_dir.resolve()).check()
    return {"base_path": str(image.base), "kernel_path": str(image.kernel), "initrd_path": str(image.initrd),
            "tag": image.tag}


def reserved_address(fleet: Fleet, host: str, index: int) -> str:
    """The address a Terraform guest of instance `index` has on `host`'s network: counted down
    from the end of the network's DHCP range (instance 1 gets the last address), the same on
    every host. At most one guest of an instance runs on a host, so no two guests share one."""
    network = fleet.config.host(host).network
    subnet, first, last = fleet.hosts[host].dhcp_range(network)
    address = ipaddress.IPv4Address(last) - (index - 1)
    if address < ipaddress.IPv4Address(first):
        size = int(ipaddress.IPv4Address(last)) - int(ipaddress.IPv4Address(first)) + 1
        raise ConfigError(f"network {network} on host {host} hands out {first}-{last} ({size} addresses): instance "
                          f"{index} has no address to reserve there; widen the DHCP range to at least {index} "
                          "addresses")
    if address not in ipaddress.ip_network(subnet):
        raise ConfigError(f"network {network} on host {host}: {address} is outside {subnet}")
    return str(address)


def tfvars_document(fleet: Fleet, host: str, instances: int) -> dict[str, Any]:
    """The variables of terraform/examples/sandbox (and, but for libvirt_uri, of the module).

    On a primary host: `instances` primaries, instance k (1..N) of the host taking
    `placement.slot(host, i)` for its fleet-wide index i. On a standby host: the standbys it
    holds of the fleet's instances 1..`instances`. Either as `pgcarve up` would place them."""
    host_config = fleet.config.host(host)
    if instances < 0:
        raise ConfigError(f"instance count must be >= 0, not {instances}")
    if host_config.role == "primary":
        start = fleet.placement.first_index(host)
        indexes = range(start, start + instances)
        if instances:
            fleet.placement.slot(host, indexes[-1])  # more than the host holds: the planner says why
    else:
        fleet.placement.check(instances)
        indexes = range(1, instances + 1)
    image = image_variable(fleet.paths.image_dir)
    domain_type = fleet.domain_types.of(host)
    provisioner = Provisioner(fleet)
    planned: dict[str, Any] = {}
    seeds: dict[str, dict[str, str]] = {}
    for index in indexes:
        guest = _planned_guest(fleet, provisioner, host_config, index)
        if guest is None:
            continue  # none of this instance's standbys is on this host
        meta, seed, address = guest
        # The domain the manager would define, so pins, NUMA node, memory and MAC are its own.
        spec = provisioner.domain_spec(host_config, seed.name, meta, _NO_VOLUMES, domain_type)
        planned[seed.name] = {
            "address": address,
            "disk_gib": fleet.config.instance.disk_gib,
            "emulator_cpus": list(spec.emulator_cpus),
            "hugepages": spec.hugepages,
            "mac": spec.nics[0].mac,
            "memory_mib": spec.memory_mib,
            "metadata": {
                "cluster": meta.cluster,
                "created_by": meta.created_by,
                "fleet": meta.fleet,
                "index": meta.index,
                "role": meta.role,
                "roles": meta.roles,
                "standby": meta.standby,
            },
            "numa_node": spec.numa_node,
            "vcpu_pins": list(spec.vcpu_pins),
        }
        # A stable instance-id: the seed is only read on a guest's first boot anyway.
        seeds[seed.name] = {"meta_data": seed.meta_data(f"{seed.name}-terraform"), "user_data": seed.user_data()}
    return {
        "libvirt_uri": host_config.uri,
        "create_pool": False,
        "pool_name": host_config.pool,
        "pool_path": host_config.pool_path,
        "network_name": host_config.network,
        "domain_type": domain_type,
        "kernel_cmdline": DEFAULT_CMDLINE,
        "image": image,
        "instances": planned,
        "seeds": seeds,
    }


def _planned_guest(fleet: Fleet, provisioner: Provisioner, host: HostConfig,
                   index: int) -> tuple[InstanceMetadata, GuestSeed, str] | None:
    """Metadata, seed and reserved address of instance `index`'s guest on `host` (None: it has none)."""
    config = fleet.config
    members = fleet.placement.guests(index)
    (primary_host, name), standbys = members[0], [(guest, h) for h, guest in members[1:]]
    addresses = {guest: reserved_address(fleet, h.name, index) for h, guest in members}
    secrets = fleet.secrets.load_or_create(name)  # whichever host is planned first makes them
    if host.name == primary_host.name:
        record = initial_record(name, name, primary_host.name, [s for s, _ in standbys], config.replication)
        seed = provisioner.seed(name, name, "primary", secrets, names_for(record) if record else "")
        guest, number = name, 0
    else:
        number = next((s for s, (_, h) in enumerate(standbys, start=1) if h.name == host.name), 0)
        if not number:
            return None
        guest = standbys[number - 1][0]
        seed = replace(provisioner.seed(guest, name, "standby", secrets, primary_host=addresses[name]),
                       create_slot=True)
    # No backup section: the fleet's repository key must not be written into a tfvars file; guests
    # laid out by Terraform do not archive yet (README, Backups).
    seed = replace(seed, replication_peers=tuple(a for g, a in addresses.items() if g != guest), backup=None)
    meta = InstanceMetadata(fleet=config.fleet, cluster=name, role="primary" if not number else "standby",
                            index=index, standby=number, created_by="terraform", roles=configured_roles(config))
    return meta, seed, addresses[guest]


# Terraform uploads the image itself: the domain's volume names and kernel paths are its own.
_NO_VOLUMES = BaseImage(disk="", kernel_path="", initrd_path="")


def render_tfvars(fleet: Fleet, host: str, instances: int) -> str:
    """`tfvars_document` as the text of a .tfvars.json file."""
    return json.dumps(tfvars_document(fleet, host, instances), indent=2) + "\n"
