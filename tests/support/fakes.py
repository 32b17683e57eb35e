"""Stand-ins for the collector and the supervisor, installed on a real ManagerService so tests on
libvirt's test driver can show the facts they would report (standbys, commits waiting, poll
errors, incidents) without polling PostgreSQL or repairing guests.

They offer exactly what ManagerService and the /metrics exporter read of the real ones.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from pgcarve.control.collector import Target
from pgcarve.control.rates import Sample
from pgcarve.control.supervisor import Incident
from pgcarve.postgres.statistics import StandbyState


class FakeCollector:
    def __init__(self) -> None:
        self.on_sample: list[Callable[[Target, Sample], None]] = []
        self.errors: dict[str, str] = {}
        self.waiting: dict[str, int] = {}
        self.standbys: dict[str, list[StandbyState]] = {}

    def last_errors(self) -> Mapping[str, str]:
        return MappingProxyType(dict(self.errors))

    def replication(self, instance: str) -> list[StandbyState]:
        return list(self.standbys.get(instance, []))

    def commits_waiting(self, instance: str) -> int:
        return self.waiting.get(instance, 0)

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def aclose(self) -> None:
        pass


def standby(name: str, sync_state: str | None, lag_bytes: int | None = 0, state: str = "streaming") -> StandbyState:
    return StandbyState(application_name=name, client_addr=None, state=state, sync_state=sync_state,
                        write_lag_s=None, flush_lag_s=None, replay_lag_s=None, lag_bytes=lag_bytes)


class FakeSupervisor:
    def __init__(self, hosts: Iterable[str]) -> None:
        self.connected = dict.fromkeys(hosts, True)
        self.counts: dict[str, int] = {}
        self._incidents: list[Incident] = []
        self._ids = itertools.count(1)

    def watching(self, host: str) -> bool:
        return self.connected.get(host, False)

    def incidents(self) -> list[Incident]:
        return list(self._incidents)

    def open_incidents(self, instance: str) -> list[Incident]:
        return [i for i in self._incidents if i.instance == instance and i.status in ("recovering", "failed")]

    def stop(self) -> None:
        pass

    def record(self, instance: str, what: str = "primary stopped", *, guest: str | None = None, host: str = "h1",
               role: str = "primary", cause: str = "the QEMU process was killed",
               detected_at: float | None = None) -> Incident:
        incident = Incident(id=next(self._ids), instance=instance, guest=guest or instance, host=host, role=role,
                            what=what, cause=cause, detected_at=time.time() if detected_at is None else detected_at,
                            source="event")
        self._incidents.append(incident)
        self.counts[what] = self.counts.get(what, 0) + 1
        return incident

    @staticmethod
    def finish(incident: Incident, status: str, action: str, message: str, finished_at: float | None = None) -> None:
        incident.attempts += 1
        incident.status, incident.action, incident.message = status, action, message
        incident.finished_at = time.time() if finished_at is None else finished_at
