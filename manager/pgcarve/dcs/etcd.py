"""The one module that speaks to etcd.

etcd 3.4 serves its v3 API as JSON through a gRPC gateway on the client port (`POST /v3/...`,
64-bit numbers as strings), and `GET /health` beside it. Every request goes over TLS with the
manager's client certificate (etcd runs with --client-cert-auth), checked against the fleet's CA;
nothing is ever sent in the clear. httpx errors are translated here, once, into
`DcsUnavailable` (the member did not answer, refused us, or answered with an error) and
`ConfigError` (our own certificate files are missing or unreadable).

Results are immutable snapshots (`EtcdMember`, `EndpointStatus`, `Probe`, `KeyRange`); what they
mean for the cluster (a leader, a quorum) is decided in dcs/health.py, and what Patroni's keys mean
in patroni/view.py. Keys and values travel base64-encoded in the gateway's JSON; they are decoded
here, so callers see text.
"""

from __future__ import annotations

import base64
import ssl
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pgcarve.config import EtcdConfig
from pgcarve.errors import ConfigError, DcsUnavailable


@dataclass(frozen=True)
class EtcdMember:
    """One member as the cluster lists it. A member added but not started yet has no name."""

    id: str  # decimal, as the gateway prints it
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]


@dataclass(frozen=True)
class EndpointStatus:
    """What one member says of itself (/v3/maintenance/status) and of its health (/health)."""

    endpoint: str
    member_id: str
    leader_id: str  # "0" when it knows of no leader
    version: str
    raft_term: int
    db_size_bytes: int
    errors: tuple[str, ...]  # e.g. "NOSPACE" alarms, as the member reports them
    healthy: bool  # /health: a leader and no alarm


@dataclass(frozen=True)
class EndpointProbe:
    """One endpoint's answer, or why there was none."""

    endpoint: str
    status: EndpointStatus | None
    error: str | None = None


@dataclass(frozen=True)
class Probe:
    """Every configured endpoint asked at once, and the member list from the first that answered."""

    endpoints: tuple[EndpointProbe, ...]
    members: tuple[EtcdMember, ...] | None  # None: no endpoint gave the list
    members_error: str | None
    at: float  # Unix time


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it. `lease` is "0" when the key has none (Patroni's leader and member
    keys have one: they vanish when their owner stops renewing it). `create_revision` changes only
    when the key is made anew, so it names one incarnation of a key (one leader's term)."""

    key: str
    value: str
    create_revision: int
    mod_revision: int
    version: int  # how many times the key was written since it was created
    lease: str


@dataclass(frozen=True)
class KeyRange:
    """Every key under a prefix, read at one revision of the store (one consistent snapshot)."""

    prefix: str
    revision: int
    kvs: tuple[KeyValue, ...]


# One range answer's size is bounded by the members' gRPC limits, not by us; a prefix read of
# everything Patroni writes for 1024 instances is a few MB.
def prefix_range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix):
    the prefix with its last byte below 0xff incremented, and what follows it dropped."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key: what an empty or all-0xff prefix means


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _text(raw: Any) -> str:
    return base64.b64decode(str(raw or "")).decode("utf-8", errors="replace")


def _key_value(raw: Mapping[str, Any]) -> KeyValue:
    return KeyValue(key=_text(raw.get("key")), value=_text(raw.get("value")),
                    create_revision=_as_int(raw.get("create_revision")), mod_revision=_as_int(raw.get("mod_revision")),
                    version=_as_int(raw.get("version")), lease=str(raw.get("lease", "0")))


def _as_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _member(raw: Mapping[str, Any]) -> EtcdMember:
    return EtcdMember(id=str(raw.get("ID", "0")), name=str(raw.get("name", "")),
                      peer_urls=tuple(str(u) for u in raw.get("peerURLs", ()) or ()),
                      client_urls=tuple(str(u) for u in raw.get("clientURLs", ()) or ()))


class EtcdClient:
    """Requests to the members named in the hosts file's etcd section, with its TLS files."""

    def __init__(self, config: EtcdConfig, timeout_s: float | None = None):
        self.config = config
        self.timeout_s = timeout_s if timeout_s is not None else config.timeout_s
        self._http = httpx.Client(verify=self._tls(), timeout=self.timeout_s)
        self._answering = 0  # the endpoint that answered last: asked first next time

    def _tls(self) -> ssl.SSLContext:
        files = {"ca_file": self.config.ca_file, "cert_file": self.config.cert_file, "key_file": self.config.key_file}
        for field, path in files.items():
            if not Path(path).is_file():
                raise ConfigError(f"etcd.{field} {path} does not exist (or is not a file): the manager needs the CA "
                                  "that signed etcd's certificates, and its own client certificate and key")
        try:
            context = ssl.create_default_context(cafile=self.config.ca_file)
            context.load_cert_chain(self.config.cert_file, self.config.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"etcd's TLS files cannot be used ({exc}): etcd.ca_file must hold PEM certificates, "
                              "etcd.cert_file and etcd.key_file the manager's PEM certificate and its key") from None
        return context

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- one request, errors translated ------------------------------------------------------

    def _request(self, endpoint: str, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        url = f"{endpoint}{path}"
        try:
            response = self._http.request(method, url, json=body)
        except httpx.TimeoutException:
            raise DcsUnavailable(f"etcd at {endpoint} did not answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            # A refused handshake (our certificate not trusted, theirs not the fleet CA's) lands here too.
            raise DcsUnavailable(f"etcd at {endpoint} cannot be reached: {exc or type(exc).__name__}") from None
        if response.status_code >= 400:
            raise DcsUnavailable(f"etcd at {endpoint} answered {path} with HTTP {response.status_code}: "
                                 f"{response.text[:200]}")
        try:
            return response.json()
        except ValueError:
            raise DcsUnavailable(f"etcd at {endpoint} answered {path} with something that is not JSON") from None

    def _post(self, endpoint: str, path: str, body: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
        doc = self._request(endpoint, "POST", path, body or {})
        if not isinstance(doc, Mapping):
            raise DcsUnavailable(f"etcd at {endpoint} answered {path} with {type(doc).__name__}, not an object")
        if "error" in doc or ("code" in doc and "message" in doc):
            raise DcsUnavailable(f"etcd at {endpoint} refused {path}: {doc.get('message') or doc.get('error')}")
        return doc

    # -- what the manager asks -----------------------------------------------------------------

    def status(self, endpoint: str) -> EndpointStatus:
        """The member behind `endpoint`: its id, the leader it follows, version, term, alarms, health."""
        doc = self._post(endpoint, "/v3/maintenance/status")
        try:
            health = self._request(endpoint, "GET", "/health")
        except DcsUnavailable:  # a member without a quorum may answer its status but not this
            health = None
        healthy = isinstance(health, Mapping) and str(health.get("health")).lower() == "true"
        return EndpointStatus(
            endpoint=endpoint, member_id=str(doc.get("header", {}).get("member_id", "0")),
            leader_id=str(doc.get("leader", "0")), version=str(doc.get("version", "")),
            raft_term=_as_int(doc.get("raftTerm")), db_size_bytes=_as_int(doc.get("dbSize")),
            errors=tuple(str(e) for e in doc.get("errors", ()) or ()), healthy=healthy)

    def members(self, endpoints: Sequence[str] | None = None) -> tuple[EtcdMember, ...]:
        """The cluster's member list, from the first endpoint that gives it."""
        last: DcsUnavailable | None = None
        for endpoint in endpoints or self.config.endpoints:
            try:
                doc = self._post(endpoint, "/v3/cluster/member/list")
            except DcsUnavailable as exc:
                last = exc
                continue
            return tuple(_member(m) for m in doc.get("members", ()) or ())
        raise last or DcsUnavailable("no etcd endpoint to ask")

    def add_member(self, peer_urls: Sequence[str]) -> EtcdMember:
        """Announce a new member (runtime reconfiguration); it must then start with
        --initial-cluster-state existing. The cluster must have a quorum."""
        last: DcsUnavailable | None = None
        for endpoint in self.config.endpoints:
            try:
                doc = self._post(endpoint, "/v3/cluster/member/add", {"peerURLs": list(peer_urls)})
            except DcsUnavailable as exc:
                last = exc
                continue
            return _member(doc.get("member", {}))
        raise last or DcsUnavailable("no etcd endpoint to ask")

    def _first_answer(self, path: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """`path` asked of the member that answered last, then of the others in turn."""
        endpoints = self.config.endpoints
        last: DcsUnavailable | None = None
        for i in range(len(endpoints)):
            index = (self._answering + i) % len(endpoints)
            try:
                doc = self._post(endpoints[index], path, body)
            except DcsUnavailable as exc:
                last = exc
                continue
            self._answering = index
            return doc
        raise last or DcsUnavailable("no etcd endpoint to ask")

    def range_prefix(self, prefix: str) -> KeyRange:
        """Every key under `prefix` in one request, sorted by key, linearizable (what a quorum
        agreed on, not one member's possibly stale copy), from the first endpoint that answers."""
        if not prefix:
            raise ValueError("a prefix read needs a prefix (an empty one would read the whole store)")
        raw = prefix.encode()
        doc = self._first_answer("/v3/kv/range", {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw)),
                                                  "sort_order": "ASCEND", "sort_target": "KEY"})
        kvs = tuple(_key_value(kv) for kv in doc.get("kvs", ()) or ())
        if doc.get("more"):  # only with a limit, which we never set; a partial answer is never taken for all
            raise DcsUnavailable(f"etcd answered a partial read of {prefix}: {len(kvs)} keys and more")
        return KeyRange(prefix, _as_int(doc.get("header", {}).get("revision")), kvs)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix` in one request; how many there were (0 when none:
        deleting again is harmless). Refuses prefixes that are not a directory ("/a/b/")."""
        if not prefix.startswith("/") or not prefix.endswith("/") or prefix.count("/") < 3:
            raise ValueError(f"refusing to delete under {prefix!r}: a prefix to delete must be a directory "
                             "two levels deep or more, like /service/pgc-01/")
        raw = prefix.encode()
        doc = self._first_answer("/v3/kv/deleterange", {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw))})
        return _as_int(doc.get("deleted"))

    def probe(self) -> Probe:
        """Every endpoint's status, asked in parallel (each bounded by the timeout), and the
        member list; never raises for an endpoint that does not answer."""
        def one(endpoint: str) -> EndpointProbe:
            try:
                return EndpointProbe(endpoint, self.status(endpoint))
            except DcsUnavailable as exc:
                return EndpointProbe(endpoint, None, str(exc))

        endpoints = self.config.endpoints
        with ThreadPoolExecutor(max_workers=min(8, len(endpoints)), thread_name_prefix="pgcarve-etcd") as pool:
            answers = tuple(pool.map(one, endpoints))
        answering = [a.endpoint for a in answers if a.status is not None]
        members: tuple[EtcdMember, ...] | None = None
        error = None
        try:
            members = self.members(answering or endpoints)
        except DcsUnavailable as exc:
            error = str(exc)
        return Probe(answers, members, error, time.time())


# -- keys, leases and transactions (the managers' leadership lease: control/leadership.py) -------


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: the key's create or mod revision equals `revision`
    (0: the key does not exist)."""

    key: str
    target: str  # "CREATE" or "MOD"
    revision: int

    def body(self) -> dict[str, str]:
        field = "create_revision" if self.target == "CREATE" else "mod_revision"
        return {"key": _b64(self.key.encode()), "target": self.target, field: str(self.revision), "result": "EQUAL"}


class EtcdKv:
    """Keys, leases and transactions, on the first endpoint that answers. Kept apart from the
    health probes above: these are what a manager decides with, and each call either gets an
    answer from the cluster or raises DcsUnavailable."""

    def __init__(self, client: EtcdClient):
        self.client = client

    def _post_any(self, path: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.client._first_answer(path, body)

    def get(self, key: str) -> KeyValue | None:
        kvs = self._post_any("/v3/kv/range", {"key": _b64(key.encode())}).get("kvs") or ()
        return _key_value(kvs[0]) if kvs else None

    def grant(self, ttl_s: int) -> str:
        """A new lease of `ttl_s` seconds; returns its ID."""
        doc = self._post_any("/v3/lease/grant", {"TTL": str(ttl_s)})
        lease = str(doc.get("ID", ""))
        if not lease or lease == "0":
            raise DcsUnavailable(f"etcd granted no lease: {dict(doc)}")
        return lease

    def keepalive(self, lease: str) -> int:
        """Renew the lease once; returns its TTL again, 0 if etcd no longer has it (it lapsed)."""
        doc = self._post_any("/v3/lease/keepalive", {"ID": lease})
        result = doc.get("result")
        return _as_int(result.get("TTL")) if isinstance(result, Mapping) else 0

    def revoke(self, lease: str) -> None:
        """Drop the lease and every key attached to it; a lease already gone is no error."""
        try:
            self._post_any("/v3/lease/revoke", {"ID": lease})
        except DcsUnavailable as exc:
            if "lease not found" not in str(exc):
                raise

    def txn(self, compares: Sequence[Compare], puts: Mapping[str, str], lease: str = "0",
            lease_keys: Sequence[str] = (), deletes: Sequence[str] = ()) -> bool:
        """Put `puts` (keys in `lease_keys` attached to `lease`) and delete `deletes` if every
        comparison holds, all at once; returns whether it did."""
        success: list[dict[str, Any]] = []
        for key, value in puts.items():
            put: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(value.encode())}
            if key in lease_keys:
                put["lease"] = lease
            success.append({"request_put": put})
        success += [{"request_delete_range": {"key": _b64(key.encode())}} for key in deletes]
        doc = self._post_any("/v3/kv/txn", {"compare": [c.body() for c in compares], "success": success})
        return bool(doc.get("succeeded"))
