"""A client of one Patroni member's REST API: its status, the cluster as it sees it, switchover,
failover, and changes to the dynamic settings (pause and resume).

Over TLS only, checked against the CA file the caller names, with basic authentication (Patroni
asks for it on everything that changes something). The caller chooses the base URL (the manager
reaches guests through a forward). Errors are translated here, once: `PatroniRefused` (Patroni
answered and said no; its reason is in the message), `PatroniUnavailable` (no answer, refused
credentials, or an answer that is not Patroni's), `ConfigError` (our own CA file, bad arguments).

Patroni answers a switchover or failover only once it is done or has failed (it polls the DCS for
up to max(10, loop_wait) * 2 s), so those requests get a longer timeout than the reads.
"""

from __future__ import annotations

import json
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import httpx

from pgcarve.errors import ConfigError, PatroniOutcomeUnknown, PatroniRefused, PatroniUnavailable
from pgcarve.patroni.view import PRIMARY_ROLES, int_or_none

READ_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 60.0  # above Patroni's own wait for a switchover's outcome (20 s with loop_wait <= 10)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


@dataclass(frozen=True)
class Replica:
    """A standby streaming from this member (a primary's `replication` list)."""

    application_name: str
    state: str  # "streaming", "catchup", ...
    sync_state: str  # "sync", "quorum", "potential", "async"


@dataclass(frozen=True)
class MemberStatus:
    """GET /patroni: what one member says of itself."""

    name: str | None  # Patroni 4 says it; 3.0 does not
    scope: str | None
    patroni_version: str | None
    state: str  # "running", "starting", "stopped", ...
    role: str  # "primary" (3.0's "master" is read as it), "replica", "standby_leader"
    timeline: int | None
    server_version: int | None  # e.g. 150018
    wal_position: int | None  # a primary's current LSN, a standby's received one
    replayed_position: int | None  # a standby's
    paused: bool
    sync_standby: bool  # this standby is synchronous
    quorum_standby: bool  # this standby counts in Patroni 4's quorum
    failsafe_active: bool  # a leader keeping its role through a DCS outage, right now
    cluster_unlocked: bool  # this member sees no leader key (etcd lost, or a leader race)
    replication: tuple[Replica, ...]
    system_identifier: str | None


@dataclass(frozen=True)
class ClusterMember:
    """One line of GET /cluster."""

    name: str
    role: str  # "leader", "sync_standby", "quorum_standby" (4.0), "replica", "standby_leader"
    state: str  # the member's state, or a standby's replication_state (4.0: "streaming")
    api_url: str | None
    host: str | None
    port: int | None
    timeline: int | None
    lag_bytes: int | None  # None for the leader, or "unknown"


@dataclass(frozen=True)
class ClusterStatus:
    """GET /cluster: every member as the answering Patroni read them from the DCS."""

    members: tuple[ClusterMember, ...]
    paused: bool

    @property
    def leader(self) -> str | None:
        return next((m.name for m in self.members if m.role in ("leader", "standby_leader")), None)


def _object(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return str(value) if value is not None and value != "" else None


def member_status(doc: Mapping[str, Any]) -> MemberStatus:
    """Parse GET /patroni's answer (3.0 and 4.0). Pure."""
    patroni = _object(doc.get("patroni"))
    xlog = _object(doc.get("xlog"))
    role = str(doc.get("role", "unknown"))
    replicas = tuple(Replica(str(r.get("application_name", "")), str(r.get("state", "")), str(r.get("sync_state", "")))
                     for r in doc.get("replication", ()) or () if isinstance(r, dict))
    return MemberStatus(
        name=_text(patroni.get("name")), scope=_text(patroni.get("scope")),
        patroni_version=_text(patroni.get("version")),
        state=str(doc.get("state", "unknown")), role="primary" if role in PRIMARY_ROLES else role,
        timeline=int_or_none(doc.get("timeline")), server_version=int_or_none(doc.get("server_version")),
        wal_position=int_or_none(xlog.get("location", xlog.get("received_location"))),
        replayed_position=int_or_none(xlog.get("replayed_location")), paused=bool(doc.get("pause")),
        sync_standby=bool(doc.get("sync_standby")), quorum_standby=bool(doc.get("quorum_standby")),
        failsafe_active=bool(doc.get("failsafe_mode_is_active")), cluster_unlocked=bool(doc.get("cluster_unlocked")),
        replication=replicas,
        system_identifier=_text(doc.get("database_system_identifier")))


def cluster_status(doc: Mapping[str, Any]) -> ClusterStatus:
    """Parse GET /cluster's answer (3.0 and 4.0). Pure."""
    members = tuple(
        ClusterMember(name=str(m.get("name", "")), role=str(m.get("role", "")), state=str(m.get("state", "")),
                      api_url=_text(m.get("api_url")), host=_text(m.get("host")), port=int_or_none(m.get("port")),
                      timeline=int_or_none(m.get("timeline")), lag_bytes=int_or_none(m.get("lag")))
        for m in doc.get("members", ()) or () if isinstance(m, dict))
    return ClusterStatus(members, bool(doc.get("pause")))


def _check_name(what: str, name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a member name (1 to 63 letters, digits, '.', '_' or '-')")
    return name


class PatroniClient:
    """Requests to one member's REST API at `base_url` (https://HOST:PORT). `member` names it in
    messages (the guest's name); nothing is sent before a request is made."""

    def __init__(self, base_url: str, *, member: str, ca_file: str, username: str, password: str,
                 timeout_s: float = READ_TIMEOUT_S, command_timeout_s: float = COMMAND_TIMEOUT_S,
                 server_name: str | None = None):
        """`server_name`: the name the member's certificate must carry when `base_url` is not it
        (a local forward to the guest): checked instead of the URL's host, and sent as SNI."""
        parts = urlsplit(base_url)
        if parts.scheme != "https" or not parts.hostname or parts.path not in ("", "/"):
            raise ConfigError(f"Patroni's REST API URL {base_url!r} must be https://HOST:PORT (TLS only)")
        if not username or not password:
            raise ConfigError(f"Patroni on {member}: its REST API needs a user name and a password")
        self.base_url = base_url.rstrip("/")
        self.member = member
        self.timeout_s = timeout_s
        self.command_timeout_s = command_timeout_s
        self._http = httpx.Client(verify=self._tls(ca_file), auth=(username, password), timeout=timeout_s)
        self._extensions = {"sni_hostname": server_name} if server_name else {}

    def _tls(self, ca_file: str) -> ssl.SSLContext:
        if not Path(ca_file).is_file():
            raise ConfigError(f"the CA file {ca_file} for Patroni's REST API does not exist (or is not a file)")
        try:
            return ssl.create_default_context(cafile=ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"the CA file {ca_file} for Patroni's REST API cannot be used ({exc}): "
                              "it must hold PEM certificates") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PatroniClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- one request, errors translated ------------------------------------------------------

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None, timeout_s: float) -> httpx.Response:
        where = f"Patroni on {self.member} ({self.base_url})"
        try:
            response = self._http.request(method, f"{self.base_url}{path}", json=body, timeout=timeout_s,
                                          extensions=self._extensions)
        except httpx.TimeoutException:
            raise PatroniUnavailable(f"{where} did not answer {method} {path} within {timeout_s:g} s") from None
        except httpx.HTTPError as exc:  # refused connection, TLS handshake (a certificate not from our CA)
            raise PatroniUnavailable(f"{where} cannot be reached: {exc or type(exc).__name__}") from None
        if response.status_code in (401, 403):
            raise PatroniUnavailable(f"{where} refused pgcarve's credentials for {method} {path} "
                                     f"(HTTP {response.status_code}: {_reason(response)})")
        return response

    def _json(self, response: httpx.Response, path: str) -> dict[str, Any]:
        try:
            doc = response.json()
        except (ValueError, json.JSONDecodeError):
            doc = None
        if not isinstance(doc, dict):
            raise PatroniUnavailable(f"Patroni on {self.member} answered {path} with HTTP {response.status_code} "
                                     f"and no JSON object: {_reason(response)}")
        return doc

    # -- reads -------------------------------------------------------------------------------

    def status(self) -> MemberStatus:
        """GET /patroni. Patroni answers 503 (with the same document) when its PostgreSQL is not
        running: that is still an answer, returned as such."""
        response = self._request("GET", "/patroni", None, self.timeout_s)
        return member_status(self._json(response, "/patroni"))

    def cluster(self) -> ClusterStatus:
        """GET /cluster: the members as this Patroni last read them from etcd."""
        response = self._request("GET", "/cluster", None, self.timeout_s)
        if response.status_code != 200:
            raise PatroniUnavailable(f"Patroni on {self.member} answered /cluster with HTTP {response.status_code}: "
                                     f"{_reason(response)}")
        return cluster_status(self._json(response, "/cluster"))

    # -- commands ----------------------------------------------------------------------------

    def switchover(self, leader: str, candidate: str | None = None) -> str:
        """Ask Patroni to hand the leader role from `leader` to `candidate` (in synchronous mode it
        must be a synchronous standby; None: Patroni picks one). Returns Patroni's message once the
        new leader holds the lock; PatroniRefused with Patroni's reason if it would not or could not."""
        body: dict[str, str] = {"leader": _check_name("the leader", leader)}
        if candidate is not None:
            body["candidate"] = _check_name("the candidate", candidate)
            if candidate == leader:
                raise ConfigError(f"a switchover from {leader} to itself is not one: name another member")
        return self._command("switchover", "/switchover", body)

    def failover(self, candidate: str) -> str:
        """A forced failover to `candidate`: Patroni promotes it even when the leader is healthy or
        gone (but, in strict synchronous mode, still only a synchronous standby). Returns Patroni's
        message; PatroniRefused with its reason."""
        return self._command("failover", "/failover", {"candidate": _check_name("the candidate", candidate)})

    def _command(self, action: str, path: str, body: Mapping[str, Any]) -> str:
        response = self._request("POST", path, body, self.command_timeout_s)
        reason = _reason(response)
        if response.status_code == 200:
            return reason
        if response.status_code == 503 and "status unknown" in reason.lower():
            raise PatroniOutcomeUnknown(f"Patroni on {self.member} does not know whether the {action} happened "
                                     f"({reason}): read the cluster's state before asking again")
        if response.status_code == 503 and "into DCS" in reason:  # Patroni could not write the request to etcd
            raise PatroniUnavailable(f"Patroni on {self.member} could not ask for the {action}: {reason}")
        if response.status_code in (400, 412, 503):
            raise PatroniRefused(f"Patroni on {self.member} refused the {action}: {reason or 'no reason given'}"
                                 f" (HTTP {response.status_code})")
        raise PatroniUnavailable(f"Patroni on {self.member} answered the {action} with HTTP {response.status_code}: "
                                 f"{reason}")

    def patch_config(self, changes: Mapping[str, Any]) -> Mapping[str, Any]:
        """PATCH /config: merge `changes` into the dynamic settings (a None value removes a key).
        Returns the settings as stored; PatroniRefused if another change won the race (HTTP 409)."""
        if not changes:
            raise ConfigError("a change of Patroni's settings needs at least one setting")
        response = self._request("PATCH", "/config", dict(changes), self.timeout_s)
        if response.status_code == 409:
            raise PatroniRefused(f"Patroni on {self.member} refused the change of its settings: another change "
                                 "was written first (HTTP 409); read them and try again")
        if response.status_code != 200:
            raise PatroniUnavailable(f"Patroni on {self.member} could not change its settings (HTTP "
                                     f"{response.status_code}: {_reason(response)})")
        return MappingProxyType(self._json(response, "/config"))

    def pause(self) -> Mapping[str, Any]:
        """Maintenance mode: Patroni stops deciding (no failover, no restart of PostgreSQL)."""
        return self.patch_config({"pause": True})

    def resume(self) -> Mapping[str, Any]:
        """Out of maintenance mode (the `pause` key removed, as patronictl resume does)."""
        return self.patch_config({"pause": None})


def _reason(response: httpx.Response) -> str:
    """Patroni's answer as one line: it writes its reasons as plain text (or JSON for documents)."""
    text = " ".join(response.text.split())
    return text[:300]
