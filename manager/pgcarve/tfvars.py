"""Terraform variables for one host: the primaries the manager would create there.

`pgcarve plan --host NAME --instances N --format tfvars` prints them as JSON, to be saved as a
`.tfvars.json` file for the module in terraform/ (JSON, not HCL: every value, seeds included,
is emitted by the json module, so no string can need HCL escaping). The layout is the manager's
own: instance i of the host gets the domain the manager would define (control/provisioning.py's
domain_spec: the placement's CPU slot and NUMA node, the MAC, the metadata) and the manager's own
seed, rendered with the fleet's credentials, so the manager lists, reaches and can log in to
every guest Terraform creates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pgcarve.control.fleet import Fleet
from pgcarve.control.provisioning import Provisioner
from pgcarve.errors import ConfigError
from pgcarve.guest.image import LocalImage
from pgcarve.naming import instance_name
from pgcarve.virt.domain_xml import DomainSpec, InstanceMetadata
from pgcarve.virt.storage import BaseImage

DEFAULT_CMDLINE: str = DomainSpec.cmdline  # the dataclass field's default: what the manager boots with


def image_variable(image_dir: Path) -> dict[str, str]:
    """The guest image's files (absolute paths on this machine) and its tag."""
    image = LocalImage(image_dir.resolve()).check()
    return {"base_path": str(image.base), "kernel_path": str(image.kernel), "initrd_path": str(image.initrd),
            "tag": image.tag}


def tfvars_document(fleet: Fleet, host: str, instances: int) -> dict[str, Any]:
    """The variables of terraform/examples/sandbox (and, but for libvirt_uri, of the module) for
    `instances` primaries on `host`: instance k (1..N) of the host takes `placement.slot(host, i)`
    for its fleet-wide index i, exactly as `pgcarve up` would place it."""
    host_config = fleet.config.host(host)
    if host_config.role != "primary":
        raise ConfigError(f"host {host} has role {host_config.role}: Terraform lays out primaries, "
                          "so pick a host with role: primary")
    if instances < 0:
        raise ConfigError(f"instance count must be >= 0, not {instances}")
    size = fleet.config.instance
    start = fleet.placement.first_index(host)
    image = image_variable(fleet.paths.image_dir)
    domain_type = fleet.domain_types.of(host)
    provisioner = Provisioner(fleet)
    planned: dict[str, Any] = {}
    seeds: dict[str, dict[str, str]] = {}
    for index in range(start, start + instances):
        name = instance_name(fleet.config.fleet, index)
        meta = InstanceMetadata(fleet=fleet.config.fleet, cluster=name, role="primary", index=index,
                                created_by="terraform")
        # The domain the manager would define, so pins, NUMA node, memory and MAC are its own.
        spec = provisioner.domain_spec(host_config, name, meta, _NO_VOLUMES, domain_type)
        planned[name] = {
            "disk_gib": size.disk_gib,
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
                "standby": meta.standby,
            },
            "numa_node": spec.numa_node,
            "vcpu_pins": list(spec.vcpu_pins),
        }
        # Terraform creates no standbys, so the primary waits for none.
        seed = provisioner.primary_seed(name, None)
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


# Terraform uploads the image itself: the domain's volume names and kernel paths are its own.
_NO_VOLUMES = BaseImage(disk="", kernel_path="", initrd_path="")


def render_tfvars(fleet: Fleet, host: str, instances: int) -> str:
    """`tfvars_document` as the text of a .tfvars.json file."""
    return json.dumps(tfvars_document(fleet, host, instances), indent=2) + "\n"
