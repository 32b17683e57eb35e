"""Deciding and doing a scale to N instances.

`plan_scale` decides from an immutable snapshot (the instances libvirt has now, and the retired
ones whose disks are kept) what to bring back, create and retire; `Scaler.scale` does it through
the fleet. Scale-down retires the highest-numbered instances (control/retirement.py: fenced,
caught up, guests undefined, disks kept); scale-up brings retired instances back from their own
disks before it creates anything new. Instances come up in parallel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pgcarve.control.capacity import check_capacity
from pgcarve.control.fleet import Fleet, Instance, Progress, no_progress
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.retirement import RetiredInstance, retire_instance, retired_instances, revive_instance
from pgcarve.control.roles_guard import refuse
from pgcarve.errors import Conflict
from pgcarve.naming import instance_name

log = logging.getLogger("pgcarve.control.scaler")


@dataclass(frozen=True)
class ScalePlan:
    target: int
    create: tuple[int, ...]  # instance numbers to create new
    revive: tuple[int, ...] = ()  # retired instance numbers to bring back from their disks
    retire: tuple[int, ...] = ()  # instance numbers to retire, highest first


def plan_scale(instances: Sequence[Instance], target: int, retired: Sequence[int] = ()) -> ScalePlan:
    """Instances are numbered 1..target: anything above target retires; anything missing comes
    back from its kept disks if it was retired, else is created."""
    present = {inst.index for inst in instances}
    missing = [i for i in range(1, target + 1) if i not in present]
    return ScalePlan(target=target,
                     create=tuple(i for i in missing if i not in retired),
                     revive=tuple(i for i in missing if i in retired),
                     retire=tuple(sorted((i for i in present if i > target), reverse=True)))


class Scaler:
    """Runs one scale at a time for a fleet (a second concurrent call gets Conflict)."""

    def __init__(self, fleet: Fleet, max_parallel: int = 8, provisioner: Provisioner | None = None):
        self.fleet = fleet
        self.provisioner = provisioner or Provisioner(fleet)
        self.max_parallel = max_parallel
        self._busy = threading.Lock()

    def scale(self, target: int, progress: Progress = no_progress) -> ScalePlan:
        """Scale to `target` instances; raises CapacityError/ConfigError, or RolesMismatch for an
        instance to retire or bring back that pgcarve does not act on, before changing anything."""
        if not self._busy.acquire(blocking=False):
            raise Conflict("another scale operation is running")
        try:
            # One listing of libvirt serves the capacity check and the decision (a listing reads
            # every guest: about a second at a thousand), made once no other scale runs.
            guests = self.fleet.guests()
            retired = {r.index: r for r in retired_instances(self.fleet)}
            check_capacity(self.fleet, target, guests, tuple(retired.values()))
            instances = self.fleet.observe(with_endpoints=False, guests=guests)
            plan = plan_scale(instances, target, tuple(retired))
            # An instance to retire or bring back that was made under the other decider of roles
            # stops the whole scale before anything changes (control/roles_guard.py).
            for mismatched in [i.roles_mismatch for i in instances if i.index in plan.retire] + [
                    retired[i].roles_mismatch for i in plan.revive]:
                refuse(mismatched)
            for index in plan.retire:
                # Read again, alone (the instance may have changed since the listing): retiring
                # reaches its guests, and reading only them keeps a scale-down linear.
                instance = self.fleet.instance_at(index)
                if instance is not None:
                    self.retire(instance, progress)
            work: list[Callable[[], object]] = [
                *(lambda r=retired[i]: self._revive(r, progress) for i in plan.revive),
                *(lambda i=i: self._create(i, progress) for i in plan.create),
            ]
            if work:
                with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(work))) as pool:
                    futures = [pool.submit(job) for job in work]
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
            log.error("creating %s failed: %s", name, exc)
            progress(name, f"failed: {exc}", 1.0)
            raise

    def _revive(self, retired: RetiredInstance, progress: Progress) -> None:
        try:
            revive_instance(self.provisioner, retired, progress)
        except Exception as exc:
            log.error("bringing %s back from retirement failed (its disks are kept, still retired): %s",
                      retired.name, exc)
            progress(retired.name, f"failed: {exc}", 1.0)
            raise

    def retire(self, instance: Instance, progress: Progress = no_progress) -> RetiredInstance:
        """Retire an instance without losing an acknowledged commit; its disks are kept."""
        return retire_instance(self.fleet, instance, progress, self.fleet.config.replication.retire_catch_up_s)
