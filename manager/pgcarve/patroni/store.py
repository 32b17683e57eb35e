"""Patroni's keys in etcd: read one scope's, or every scope's in one request, and purge one.

Only dcs/etcd.py speaks to etcd; this module says which keys. Reads are linearizable range reads,
so a view is one consistent revision of the store, never a mix of before and after a switchover.
"""

from __future__ import annotations

from pgcarve.dcs.etcd import EtcdClient
from pgcarve.patroni.view import (
    NAMESPACE,
    ClusterView,
    check_namespace,
    cluster_view,
    cluster_views,
    scope_prefix,
)


def read_cluster(client: EtcdClient, scope: str, namespace: str = NAMESPACE) -> ClusterView | None:
    """One scope's view (one request); None when it has no keys (never bootstrapped, or purged).
    DcsUnavailable when no etcd endpoint answers."""
    prefix = scope_prefix(scope, namespace)
    found = client.range_prefix(prefix)
    if not found.kvs:
        return None
    return cluster_view(scope, found.revision, {kv.key[len(prefix):]: kv for kv in found.kvs})


def read_all(client: EtcdClient, namespace: str = NAMESPACE) -> dict[str, ClusterView]:
    """Every scope under `namespace` (one request for the whole fleet): scope -> view. A scope
    with no keys is absent. DcsUnavailable when no etcd endpoint answers."""
    found = client.range_prefix(check_namespace(namespace))
    return cluster_views(found.kvs, found.revision, namespace)


def purge_cluster(client: EtcdClient, scope: str, namespace: str = NAMESPACE) -> int:
    """Delete every key of `scope` (for an instance being purged, once its guests are gone: a
    running Patroni would write its member key and bootstrap again). How many keys there were; 0
    when none, so a purge can be retried."""
    return client.delete_prefix(scope_prefix(scope, namespace))
