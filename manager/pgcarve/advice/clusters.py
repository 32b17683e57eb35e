"""The multi-instance case's clusters: N PostgreSQL clusters in one guest, the experiment's "several
primaries on one kernel". The image's pgcarve-clusters makes clusters 2..N at boot (ports 5433..)
when the fleet's instance.clusters is N; each replicates to the same cluster of the instance's
standbys. The manager knows only the first; here each is reached as a Guest of its own."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import psycopg

from pgcarve.control.fleet import POSTGRES_PORT, Fleet, Guest
from pgcarve.errors import GuestNotReady
from pgcarve.naming import application_name
from pgcarve.postgres import replication
from pgcarve.postgres.session import first_line


def cluster_port(k: int) -> int:
    """Cluster k's port in its guest (k = 1 is the guest's own cluster)."""
    return POSTGRES_PORT + k - 1


def cluster_guest(fleet: Fleet, guest: Guest, k: int) -> Guest:
    """`guest` seen through its cluster k: the same guest with that cluster's endpoint."""
    if k == 1:
        return guest
    return replace(guest, endpoint=fleet.endpoint_at(guest, cluster_port(k)))


def wait_clusters(fleet: Fleet, primary: Guest, count: int, standbys: Sequence[str], timeout_s: float,
                  progress: Callable[[str], None] = lambda _m: None, poll_s: float = 2.0) -> list[Guest]:
    """The primary's `count` clusters, once each accepts the admin's login and every one of
    `standbys` (guest names) streams to it: pgcarve-clusters makes them after the guest's own
    cluster is up, so they are ready some time after the manager says the instance is."""
    wanted = {application_name(s) for s in standbys}
    deadline = time.monotonic() + timeout_s
    ready: list[Guest] = []
    for k in range(1, count + 1):
        last = told = "not tried"
        while True:
            guest = cluster_guest(fleet, primary, k)
            try:
                with fleet.connect(guest, timeout_s=3) as conn:
                    streaming = replication.streaming_standbys(conn)
                if wanted <= streaming:
                    ready.append(guest)
                    break
                last = f"streaming standbys {sorted(streaming)}, waiting for {sorted(wanted)}"
            except (psycopg.Error, GuestNotReady) as exc:
                last = first_line(exc)
            if time.monotonic() > deadline:
                raise GuestNotReady(f"{primary.name}: cluster {k} (port {cluster_port(k)}) not ready with its "
                                    f"standbys after {timeout_s:.0f} s: {last}")
            if last != told:  # each state once, not every poll
                progress(f"{primary.name} cluster {k} (port {cluster_port(k)}): {last}")
                told = last
            time.sleep(poll_s)
    return ready
