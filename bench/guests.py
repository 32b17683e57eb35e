"""Hosts for the parts that boot guests: the local sandbox (always stopped again) or real hosts
from a hosts file, fleets sized for a case, and getting rid of the bench's guests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pgcarve.config import FleetConfig, load_fleet_config
from pgcarve.control.fleet import Fleet, Progress
from pgcarve.errors import PgcarveError
from pgcarve.guest.image import LocalImage
from pgcarve.settings import Paths

from bench.harness import log


@contextlib.contextmanager
def guest_hosts(paths: Paths, hosts: int, hosts_file: Path | None, record: dict[str, Any]) -> Iterator[FleetConfig]:
    """Real hosts from a hosts file, or a sandbox of `hosts` hosts that is always stopped again."""
    LocalImage(paths.image_dir).check()
    if hosts_file is not None:
        config = load_fleet_config(hosts_file)
        record["hosts"] = {"kind": "hosts file", "file": str(hosts_file), "hosts": [h.name for h in config.hosts]}
        yield config
        return
    from pgcarve.sandbox.hosts import Sandbox

    sandbox = Sandbox(paths.sandbox_dir)
    if sandbox.is_up():
        raise PgcarveError(f"a sandbox is already up in {paths.sandbox_dir} (another bench running?); "
                           f"stop it with `PGCARVE_STATE_DIR={paths.state_dir} pgcarve sandbox down`")
    if sandbox.hosts() or sandbox.leftovers():
        sandbox.down()  # a crashed earlier bench run of this state directory left pieces
    record["hosts"] = {"kind": "sandbox", "state_dir": str(paths.state_dir), "hosts": hosts}
    try:
        log(f"sandbox: starting {hosts} host(s) in {paths.state_dir}")
        yield sandbox.up(hosts, progress=log)
    finally:
        log("sandbox: down")
        sandbox.down(progress=log)
        record["sandbox_leftovers"] = sandbox.leftovers()
        if record["sandbox_leftovers"]:
            log(f"sandbox left behind: {record['sandbox_leftovers']}")


def prepare_hosts(fleet: Fleet) -> dict[str, Any]:
    """Once per host, outside any timed section: upload the image, settle the domain type, and read
    the topology (a fresh libvirtd probes QEMU on its first getCapabilities, which takes seconds;
    a long-running one has that cached)."""
    t = time.perf_counter()
    types = {}
    for host in fleet.config.hosts:
        fleet.images.on(host.name)
        types[host.name] = fleet.domain_types.of(host.name)
        fleet.topology(host.name)
    return {"seconds": round(time.perf_counter() - t, 2), "domain_type": types,
            "capacity": fleet.placement.capacity()}


def progress_logger(prefix: str) -> Progress:
    """A progress callback that logs each guest's step once."""
    last: dict[str, str] = {}
    lock = threading.Lock()

    def progress(name: str, step: str, _fraction: float) -> None:
        with lock:
            if last.get(name) != step:
                last[name] = step
                log(f"{prefix}{name}: {step}")

    return progress

