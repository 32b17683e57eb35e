"""The service's cached view of the fleet: what the API and the dashboard read, so that reads
never wait on libvirt or PostgreSQL (control/service.py refreshes it)."""

from __future__ import annotations

from dataclasses import dataclass

from pgcarve.control.fleet import Instance
from pgcarve.control.retired import RetiredInstance


@dataclass(frozen=True)
class FleetView:
    """The instances as last observed (immutable; replaced wholesale on refresh)."""

    instances: tuple[Instance, ...]
    observed_at: float
    error: str | None = None
    retired: tuple[RetiredInstance, ...] = ()  # kept disks, no guests (control/retired.py)
    busy: tuple[tuple[int, str], ...] = ()  # instances held by work then (Fleet.locks), by index

    def content(self) -> tuple[object, ...]:
        """What the instances' documents are built from: the same objects for as long as
        refreshes find nothing changed (ManagerService.refresh keeps them), so comparing
        contents is quick until something changes."""
        return self.instances, self.retired, self.error, self.busy
