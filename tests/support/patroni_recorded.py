"""Patroni's keys as a real Patroni 4.0 wrote them (tests/data/patroni), one cluster per instance
of the test driver's fleet: what the API, /metrics and the dashboard show under
replication.roles: patroni, without guests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pgcarve.dcs.etcd import KeyValue
from pgcarve.patroni.view import ClusterView, cluster_views

from tests.support.domains import instance_names
from tests.unit.test_patroni_view import recorded

INSTANCES = instance_names(3)


class RecordedPatroni:
    """Patroni's keys as a real Patroni 4.0 wrote them (tests/data/patroni), one steady cluster per
    instance. The recording's leader was
    pgc-01-s1; its members' names are swapped so that each instance is led by its first guest, as
    the test driver's instances are."""

    def __init__(self, instances: Sequence[str] = INSTANCES) -> None:
        self.error: str | None = None
        kvs: list[KeyValue] = []
        revision = 0
        for name in instances:
            found, revision = recorded("patroni-4.0.7", "steady")

            def rename(text: str, name: str = name) -> str:
                return text.replace("pgc-01-s1", "@").replace("pgc-01", f"{name}-s1").replace("@", name)

            scope = "/service/pgc-01/"
            kvs += [replace(kv, key=f"/service/{name}/{rename(kv.key.removeprefix(scope))}", value=rename(kv.value))
                    for kv in found]
        self.views = cluster_views(kvs, revision)

    def last_read(self) -> tuple[dict[str, ClusterView], float | None]:
        return self.views, 1.0

    def leader(self, instance: str, fresh: bool = False) -> str | None:
        view = self.views.get(instance)
        return view.leader if view is not None else None


def recorded_patroni(instances: Sequence[str] = INSTANCES) -> RecordedPatroni:
    return RecordedPatroni(instances)
