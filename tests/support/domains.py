"""pgcarve guests on libvirt's test driver (test:///default), defined as the manager defines them.

No guest boots: each one is a running test-driver domain carrying pgcarve's metadata, which is
all the manager reads back. test:///default's state is shared by every connection of this
process and is reset when the last one closes, so callers keep the connection they get open for
as long as the domains should exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import libvirt
from pgcarve.naming import instance_name
from pgcarve.virt.domain_xml import DomainSpec, InstanceMetadata, Nic, mac_for

TEST_URI = "test:///default"
FLEET = "pgc"
# test:///default lists 16 CPUs, but its node CPU map (and so vcpuPinInfo) only covers 0-7;
# CPU 0 is left to emulator threads.
PINNABLE_CPUS = tuple(range(1, 8))


def instance_names(count: int) -> tuple[str, ...]:
    """pgc-01 .. pgc-<count>: the names of instances 1..count."""
    return tuple(instance_name(FLEET, index) for index in range(1, count + 1))


def guest_spec(index: int, *, standby: int = 0, creating: bool = False, vcpus: int = 1,
               memory_mib: int = 1024) -> DomainSpec:
    """Instance `index`'s primary (or its standby `standby`).

    Instance i gets the next `vcpus` CPUs of PINNABLE_CPUS, wrapping round: not where the planner
    would put it (the driver has too few pinnable CPUs), but pinned as a real one is. With one
    vCPU, instance i (i < 8) is on CPU i.
    """
    cluster = instance_name(FLEET, index)
    name = f"{cluster}-s{standby}" if standby else cluster
    first = vcpus * (index - 1)
    pins = tuple(PINNABLE_CPUS[(first + k) % len(PINNABLE_CPUS)] for k in range(vcpus))
    return DomainSpec(
        name=name, domain_type="qemu",
        metadata=InstanceMetadata(fleet=FLEET, cluster=cluster, role="standby" if standby else "primary",
                                  index=index, standby=standby),
        memory_mib=memory_mib, vcpu_pins=pins, emulator_cpus=(0,), numa_node=0,
        kernel="/nonexistent/vmlinuz", initrd="/nonexistent/initrd.img", disks=(),
        nics=(Nic("default", mac_for(FLEET, name)),), creating=creating,
    )


def define(conn: libvirt.virConnect, index: int, creating: bool = False, standby: int = 0, *, vcpus: int = 1,
           memory_mib: int = 1024) -> str:
    """Define and start instance `index`'s primary (or standby `standby`); returns its name."""
    spec = guest_spec(index, standby=standby, creating=creating, vcpus=vcpus, memory_mib=memory_mib)
    conn.defineXML(spec.to_xml()).create()
    return spec.name


def remove_domains(conn: libvirt.virConnect, names: Sequence[str]) -> None:
    """Power off and undefine these domains, wherever they are in their life."""
    for name in names:
        try:
            dom = conn.lookupByName(name)
            if dom.isActive():
                dom.destroy()
            dom.undefine()
        except libvirt.libvirtError:
            pass


def reset_test_driver(instances: Sequence[int] = (), *, vcpus: int = 1, memory_mib: int = 1024) -> libvirt.virConnect:
    """Empty test:///default (whatever an earlier test left would be taken for part of the fleet),
    then define running primaries of `instances`. The returned connection keeps the driver's state
    alive: close it when the test is done."""
    conn = libvirt.open(TEST_URI)
    remove_domains(conn, [dom.name() for dom in conn.listAllDomains()])
    # Volumes too: a retired instance's kept disks (control/retired.py) are found by their names.
    for pool in conn.listAllStoragePools():
        if not pool.isActive():
            continue
        for volume in pool.listAllVolumes():
            if volume.name().startswith("pgc-"):
                with contextlib.suppress(libvirt.libvirtError):
                    volume.delete(0)
    for index in instances:
        define(conn, index, vcpus=vcpus, memory_mib=memory_mib)
    return conn
