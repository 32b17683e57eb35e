"""Canned etcd answers for tests that decide from them (doctor, /metrics) without an etcd."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EndpointProbe, EndpointStatus, EtcdMember, Probe

CONFIG = EtcdConfig(endpoints=["https://127.0.0.1:12379", "https://127.0.0.1:22379", "https://127.0.0.1:32379"],
                    ca_file="/nonexistent/ca.pem", cert_file="/nonexistent/client.pem",
                    key_file="/nonexistent/client.key")


def member_id(name: str) -> str:
    return str(1000 + sum(ord(c) for c in name))


def cluster(names: Sequence[str], down: Sequence[str] = (), leader: str | None = None,
            endpoints: Sequence[str] | None = None, unhealthy: Sequence[str] = (),
            listed: bool = True) -> Probe:
    """A probe of members `names`, one endpoint each (in order): those in `down` do not answer,
    those in `unhealthy` answer but report no health; the others follow `leader` (default: the
    first member that is up). `listed` False: no endpoint gave the member list."""
    endpoints = list(endpoints or CONFIG.endpoints)[:len(names)]
    up = [n for n in names if n not in down]
    chosen = leader if leader is not None else (up[0] if up else None)
    answers = []
    for name, endpoint in zip(names, endpoints, strict=False):
        if name in down:
            answers.append(EndpointProbe(endpoint, None, f"etcd at {endpoint} cannot be reached: refused"))
            continue
        answers.append(EndpointProbe(endpoint, EndpointStatus(
            endpoint=endpoint, member_id=member_id(name), leader_id=member_id(chosen) if chosen else "0",
            version="3.4.23", raft_term=2, db_size_bytes=20480, errors=(), healthy=name not in unhealthy)))
    members = tuple(EtcdMember(member_id(n), n, (f"https://10.76.0.{i + 1}:2380",), (f"https://10.76.0.{i + 1}:2379",))
                    for i, n in enumerate(names))
    return Probe(tuple(answers), members if listed else None, None if listed else "no endpoint answered", time.time())


class FakeEtcdClient:
    """Stands in for pgcarve.dcs.etcd.EtcdClient: `probe()` returns FakeEtcdClient.answer."""

    answer: Probe = cluster(["h0", "h1", "h2"])

    def __init__(self, config: EtcdConfig, timeout_s: float | None = None):
        self.config = config

    def __enter__(self) -> FakeEtcdClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        pass

    def probe(self) -> Probe:
        return FakeEtcdClient.answer
