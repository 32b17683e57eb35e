"""Terraform variables for one host: the primaries the manager would create there.

`pgcarve plan --host NAME --instances N --format tfvars` prints them as JSON, to be saved as a
`.tfvars.json` file for the module in terraform/ (JSON, not HCL: every value, seeds included,
is emitted by the json module, so no string can need HCL escaping). The layout is the manager's
own: instance i of the host gets the name, CPU slot (`Fleet.slot`), NUMA node, MAC and metadata
the manager would give it, and a seed rendered with the fleet's credentials, so the manager
lists, reaches and can log in to every guest Terraform creates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pgcarve.config import HostConfig
from pgcarve.control.fleet import Fleet, instance_name
from pgcarve.errors import ConfigError, ImageMissing
from pgcarve.guest.seed import GuestSeed
from pgcarve.planning.planner import capacity
from pgcarve.virt.domain_xml import DomainSpec, InstanceMetadata, mac_for

IMAGE_FILES = {"base_path": "base.qcow2", "kernel_path": "vmlinuz", "initrd_path": "initrd.img"}
DEFAULT_CMDLINE: str = DomainSpec.cmdline  # the dataclass field's default: what the manager boots with


def image_variable(fleet: Fleet) -> dict[str, str]:
    """The guest image's files (absolute paths on this machine) and its tag."""
    image_dir = fleet.paths.image_dir.resolve()
    inputs = image_dir / "inputs.sha256"
    if not inputs.exists():
        raise ImageMissing(
            f"no guest image in {image_dir}: build it with `make image` (or images/build.sh {image_dir})"
        )
    image = {key: str(image_dir / filename) for key, filename in IMAGE_FILES.items()}
    missing = [path for path in image.values() if not Path(path).exists()]
    if missing:
        raise ImageMissing(f"the guest image in {image_dir} is incomplete: {', '.join(missing)} missing")
    image["tag"] = inputs.read_text().strip()[:12]
    return image


def first_index(fleet: Fleet, host: HostConfig) -> int:
    """The fleet-wide index of the host's first instance (primary hosts are filled in order)."""
    offset = 0
    for other in fleet.config.primary_hosts:
        if other.name == host.name:
            return offset + 1
        offset += capacity(fleet.topology(other.name), fleet.planner_config)
    raise ConfigError(f"host {host.name} is not a primary host")


def tfvars_document(fleet: Fleet, host: str, instances: int) -> dict[str, Any]:
    """The variables of terraform/examples/sandbox (and, but for libvirt_uri, of the module) for
    `instances` primaries on `host`: instance k (1..N) of the host takes `Fleet.slot(host, i)`
    for its fleet-wide index i, exactly as `pgcarve up` would place it."""
    host_config = fleet.config.host(host)
    if host_config.role != "primary":
        raise ConfigError(f"host {host} has role {host_config.role}: Terraform lays out primaries, "
                          "so pick a host with role: primary")
    if instances < 0:
        raise ConfigError(f"instance count must be >= 0, not {instances}")
    size = fleet.config.instance
    repl = fleet.config.replication
    start = first_index(fleet, host_config)
    image = image_variable(fleet)
    domain_type = fleet.domain_type(host)
    planned: dict[str, Any] = {}
    seeds: dict[str, dict[str, str]] = {}
    for index in range(start, start + instances):
        name = instance_name(fleet.config.fleet, index)
        plan, slot = fleet.slot(host, index)
        meta = InstanceMetadata(fleet=fleet.config.fleet, cluster=name, role="primary", index=index,
                                created_by="terraform")
        planned[name] = {
            "disk_gib": size.disk_gib,
            "emulator_cpus": list(plan.emulator_cpus),
            "hugepages": size.hugepages,
            "mac": mac_for(fleet.config.fleet, name),
            "memory_mib": slot.memory_mib,
            "metadata": {
                "cluster": meta.cluster,
                "created_by": meta.created_by,
                "fleet": meta.fleet,
                "index": meta.index,
                "role": meta.role,
                "standby": meta.standby,
            },
            "numa_node": slot.numa_node,
            "vcpu_pins": list(slot.host_cpus),
        }
        # Terraform creates no standbys, so the primary waits for none.
        seed = GuestSeed(name=name, role="primary", credentials=fleet.credentials,
                         allowed_cidrs=tuple(fleet.config.allowed_cidrs),
                         synchronous_commit=repl.synchronous_commit, synchronous_standby_names="")
        # A stable instance-id: the seed is only read on a guest's first boot anyway.
        seeds[name] = {"meta_data": seed.meta_data(f"{name}-terraform"), "user_data": seed.user_data()}
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


def render_tfvars(fleet: Fleet, host: str, instances: int) -> str:
    """`tfvars_document` as the text of a .tfvars.json file."""
    return json.dumps(tfvars_document(fleet, host, instances), indent=2) + "\n"
