"""The one small HTTP client every API-calling command uses (scale, switchover, failover, incidents,
status, load, server, connect, dsn, service-file)."""

from __future__ import annotations

import json
import ssl
import time
from typing import Any
from urllib.parse import quote

import httpx

from pgcarve.control.manager_lock import running_servers
from pgcarve.errors import PgcarveError
from pgcarve.processes import ProcessStatus, check, read_record
from pgcarve.settings import Paths, Settings


def read_server(paths: Paths) -> dict[str, Any] | None:
    """{pid, url, ca_file, ...} of the running API server from server.json, or None when none
    runs (no file, or its PID has exited, was reused or is from before a reboot)."""
    record, data = read_record(paths.server_file)
    if record is not None and check(record) is ProcessStatus.RUNNING:
        return data
    others = running_servers(paths.servers_dir)  # another server of this state directory still runs
    return others[-1][1] if others else None


def local_leader(paths: Paths) -> dict[str, Any] | None:
    """Of the servers this state directory runs, the one that leads (asked on /healthz), since only
    it accepts changes; else the one server.json names."""
    running = [data for _record, data in running_servers(paths.servers_dir)]
    for server in running if len(running) > 1 else ():
        try:
            health = httpx.get(f"{server['url']}/healthz", timeout=2, verify=server_verify(server)).json()
        except (httpx.HTTPError, ValueError):
            continue
        if isinstance(health, dict) and health.get("role") == "leader":
            return server
    return read_server(paths)


def server_verify(server: dict[str, Any] | None) -> ssl.SSLContext | bool:
    """How to verify a server's HTTPS: with the fleet CA that issued its certificate (server.json's
    ca_file), else with the system's CAs (an operator's own certificate)."""
    ca_file = server.get("ca_file") if server else None
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


class ApiError(PgcarveError):
    """The API refused a request; the message is its own explanation."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"{detail} (HTTP {status})")
        self.status = status
        self.detail = detail


# How long `pgcarve load` waits for the API to have read every primary, before the load and
# after it (a 1-vCPU emulated guest saturated by the load can leave its poller unanswered that long).
SAMPLE_WAIT_S = 60.0


class ApiClient:
    """Calls a pgcarve API server with the token from PGCARVE_TOKEN or the state directory."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0,
                 verify: ssl.SSLContext | bool = True):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.verify = verify

    @classmethod
    def for_settings(cls, settings: Settings, url: str | None = None) -> ApiClient:
        """The client of the local server (server.json), or of `url`."""
        paths = settings.paths
        token = settings.token
        if not token and paths.token_file.exists():
            token = paths.token_file.read_text().strip()
        server = local_leader(paths) if url is None else read_server(paths)
        if server is not None and (url is None or url.rstrip("/") == server["url"]):
            return cls(server["url"], token, verify=server_verify(server))
        return cls(url or f"http://127.0.0.1:{settings.port}", token)

    def _check(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                detail = str(resp.json().get("detail", resp.text))
            except (json.JSONDecodeError, AttributeError):
                detail = resp.text
            raise ApiError(resp.status_code, detail)
        return resp.json()

    def _get(self, path: str, params: dict[str, Any]) -> httpx.Response:
        try:
            return httpx.get(f"{self.url}{path}", params=params, headers=self.headers, timeout=self.timeout_s,
                             verify=self.verify)
        except httpx.ConnectError as exc:
            raise ApiError(0, f"no pgcarve API answers at {self.url} ({exc}): start it with `pgcarve server start`, "
                              "or name another with --url") from None

    def get(self, path: str, **params: Any) -> Any:
        return self._check(self._get(path, params))

    def get_text(self, path: str, **params: Any) -> str:
        """A non-JSON resource (the CA's PEM)."""
        resp = self._get(path, params)
        if resp.status_code >= 400:
            self._check(resp)
        return resp.text

    def instance(self, name: str) -> dict[str, Any]:
        """GET /v1/instances/{name}."""
        doc: dict[str, Any] = self.get(f"/v1/instances/{quote(name, safe='')}")
        return doc

    def credentials(self, name: str) -> dict[str, str]:
        """The instance's application login {user, password, database} (needs the token)."""
        doc: dict[str, str] = self.get(f"/v1/instances/{quote(name, safe='')}/credentials")
        return doc

    def put(self, path: str, body: dict[str, Any]) -> Any:
        return self._check(httpx.put(f"{self.url}{path}", json=body, headers=self.headers, timeout=self.timeout_s,
                                     verify=self.verify))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._check(httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=self.timeout_s,
                                      verify=self.verify))

    def delete(self, path: str, **params: Any) -> Any:
        return self._check(httpx.delete(f"{self.url}{path}", params=params, headers=self.headers,
                                        timeout=self.timeout_s, verify=self.verify))

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2, verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_until_sampled(self, instances: list[str], wait_s: float = SAMPLE_WAIT_S,
                           since: float = 0.0) -> list[str]:
        """Wait until the API's collector has sampled every one of `instances` at or after the
        unix time `since` (0: any first sample, its baseline), at most `wait_s`; the names it
        still lacks then. A load started before an instance's baseline has its first transactions
        in no difference of totals: a server started just before the load, polling guests that
        are busy, takes a few rounds. And a baseline older than the last writes before the load
        (a primary that did not answer for a while) would count those writes with the load."""
        deadline = time.monotonic() + wait_s
        while True:
            sampled = self.get("/v1/tps").get("instances", {})
            missing = sorted(name for name in instances
                             if name not in sampled or sampled[name].get("sampled_at", since) < since)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.5)

    def transactions_during(self, started: float, finished: float, wait_s: float = SAMPLE_WAIT_S,
                            instances: tuple[str, ...] = ()) -> int | None:
        """Client transactions the API counted from `started` until the load was idle after
        `finished`: the difference of its running total (xacts_total) between the last sample
        before `started` and the first one taken 3 s past `finished` (the last commits are
        published up to ~1 s late) in which every one of `instances` was polled after that
        moment too (a primary too busy to answer the collector is counted only up to its last
        answer). Waits for that sample at most `wait_s`; None if none arrives, the history does
        not reach back to `started`, or the sample before `started` had no baseline yet for one
        of `instances` (its first commits would be missed)."""
        settled = finished + 3

        def complete(point: dict[str, Any]) -> bool:
            sampled = point.get("instances", {})
            return point["at"] >= settled and all(
                name in sampled and sampled[name].get("sampled_at", point["at"]) >= settled for name in instances)

        deadline = time.monotonic() + wait_s
        while True:
            seconds = max(1, int(time.time() - started) + 5)
            history = self.get("/v1/tps/history", seconds=seconds)
            before = [p for p in history if p["at"] <= started]
            after = [p for p in history if complete(p)]
            if before and not set(instances) <= set(before[-1].get("instances", {})):
                return None
            if before and after:
                return int(after[0]["xacts_total"]) - int(before[-1]["xacts_total"])
            if time.monotonic() >= deadline or (history and not before):
                return None
            time.sleep(0.5)  # the collector records one sample per second
