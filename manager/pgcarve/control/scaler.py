"""Deciding and doing a scale to N instances.

`plan_scale` decides from an immutable snapshot (the instances libvirt has now) what to create
and what to remove; `Scaler.scale` does it through the fleet. Scale-up creates instances in
parallel. Scale-down removes the highest-numbered instances, each only after new writes to its
primary are refused and its synchronous standby has replayed everything the primary wrote.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psycopg

from pgcarve.control.capacity import check_capacity
from pgcarve.control.fleet import Fleet, Instance, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.removal import remove_instance
from pgcarve.errors import Conflict, GuestNotReady
from pgcarve.naming import instance_name
from pgcarve.postgres import replication

log = logging.getLogger("pgcarve.control.scaler")


@dataclass(frozen=True)
class ScalePlan:
    target: int
    create: tuple[int, ...]  # instance numbers to create
    remove: tuple[int, ...]  # instance numbers to remove, highest first


def plan_scale(instances: Sequence[Instance], target: int) -> ScalePlan:
    """Instances are numbered 1..target; anything above target goes, anything missing comes."""
    present = {inst.index for inst in instances}
    create = tuple(i for i in range(1, target + 1) if i not in present)
    remove = tuple(sorted((i for i in present if i > target), reverse=True))
    return ScalePlan(target=target, create=create, remove=remove)


class Scaler:
    """Runs one scale at a time for a fleet (a second concurrent call gets Conflict)."""

    def __init__(self, fleet: Fleet, max_parallel: int = 8):
        self.fleet = fleet
        self.provisioner = Provisioner(fleet)
        self.max_parallel = max_parallel
        self._busy = threading.Lock()

    def scale(self, target: int, progress: Progress = no_progress) -> ScalePlan:
        """Scale to `target` instances; raises CapacityError/ConfigError before changing anything."""
        check_capacity(self.fleet, target)
        if not self._busy.acquire(blocking=False):
            raise Conflict("another scale operation is running")
        try:
            plan = plan_scale(self.fleet.observe(with_endpoints=False), target)
            for index in plan.remove:
                self.retire(self.fleet.instance(instance_name(self.fleet.config.fleet, index)), progress)
            if plan.create:
                with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(plan.create))) as pool:
                    futures = [pool.submit(self._create, i, progress) for i in plan.create]
                    errors = []
                    for future in futures:
                        try:
                            future.result()
                        except Exception as exc:
                            errors.append(exc)
                    if errors:
                        raise errors[0]
            return plan
        finally:
            self._busy.release()

    def _create(self, index: int, progress: Progress) -> None:
        name = instance_name(self.fleet.config.fleet, index)
        try:
            self.provisioner.create_instance(index, progress)
        except Exception as exc:
            # Say so at once: the operation only fails after its other instances finish.
            log.error("creating %s failed (its guests and disks were removed): %s", name, exc)
            progress(name, f"failed: {exc}", 1.0)
            raise

    def retire(self, instance: Instance, progress: Progress = no_progress, timeout_s: float = 120) -> None:
        """Remove an instance without losing an acknowledged commit that the fleet would keep.

        New writes are refused first (read-only default, other sessions ended), then we wait
        until the synchronous standbys have replayed the primary's last WAL position. The
        instance's data goes with it: scale-down removes whole instances.
        """
        with self.fleet.locks.exclusive(instance.index, "removing"):
            self._retire(instance, progress, timeout_s)

    def _retire(self, instance: Instance, progress: Progress, timeout_s: float) -> None:
        primary = instance.primary
        if primary is not None and primary.info.state == "running" and instance.standbys:
            progress(instance.name, "refusing new writes", 0.2)
            standbys = [s.name for s in instance.standbys]
            try:
                with self.fleet.connect(primary) as conn:
                    lsn = replication.refuse_writes(conn)
                    progress(instance.name, "waiting for standbys to replay", 0.5)
                    deadline = time.monotonic() + timeout_s
                    while not replication.synchronous_standbys_at(conn, standbys, lsn):
                        if time.monotonic() > deadline:
                            raise GuestNotReady(f"{instance.name}: no synchronous standby replayed up to {lsn} "
                                                f"in {timeout_s:.0f} s; instance kept")
                        time.sleep(0.2)
            except psycopg.Error as exc:
                raise GuestNotReady(f"{instance.name}: could not fence writes before removal: {exc}") from None
        progress(instance.name, "removing guests and disks", 0.8)
        remove_instance(self.fleet, instance)
        progress(instance.name, "removed", 1.0)
