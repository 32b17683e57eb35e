"""The real app and ManagerService on libvirt's test driver, for the API's tests (unit, fuzz,
security) and the live API of the browser and monitoring tests (tests/support/live_api.py).

One host, h1 on test:///default, no standbys, instances pgc-01.. defined as running domains
(tests/support/domains.py). The service neither polls PostgreSQL (collect=False: the test driver
hands out addresses of a real private range, 192.168.122.x, and nothing may connect there) nor
supervises. Its state directory holds no guest image, so a scale-up is accepted and then fails
with ImageMissing ("no guest image"), while a scale-down really removes domains.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pgcarve.config import FleetConfig
from pgcarve.control.service import ManagerService
from pgcarve.naming import instance_name
from pgcarve.settings import Paths
from pgcarve.statedir.layout import make_fleet_secrets
from pgcarve_api.main import create_app
from pgcarve_api.settings import Settings
from starlette.types import Message

from tests.support.domains import TEST_URI, reset_test_driver


def one_host_config(vcpus: int = 1, memory_mib: int = 1024, sandbox: bool = False) -> FleetConfig:
    """One primary host, h1 on test:///default, instances of this size and no standbys; reached
    like a sandbox host (loopback forwards by guest name) if `sandbox`."""
    reach = {"reach": "sandbox", "netns": "pgc-unit-h0"} if sandbox else {}
    return FleetConfig.model_validate({
        "hosts": [{"name": "h1", "uri": TEST_URI, "role": "primary", **reach}],
        "instance": {"vcpus": vcpus, "memory_mib": memory_mib},
        "replication": {"standbys": 0},
    })


@contextlib.contextmanager
def service_on_test_driver(state_dir: Path, instances: int = 3, *, vcpus: int = 1, memory_mib: int = 1024,
                           refresh_s: float = 0.2, sandbox: bool = False) -> Iterator[ManagerService]:
    """A started ManagerService over instances pgc-01..pgc-<instances> (running, `vcpus` each);
    stopped, and the test driver let go, on the way out."""
    keep_alive = reset_test_driver(range(1, instances + 1), vcpus=vcpus, memory_mib=memory_mib)
    try:
        make_fleet_secrets(Paths(state_dir))  # as `serve` makes them for a new fleet
        service = ManagerService(one_host_config(vcpus, memory_mib, sandbox), Paths(state_dir),
                                 refresh_s=refresh_s, collect=False, supervise=False)
        for index in range(1, instances + 1):  # their passwords, as if the manager had seeded them
            service.fleet.secrets.load_or_create(instance_name(service.config.fleet, index))
        service.start()
        try:
            yield service
        finally:
            service.wait_idle(10)
            service.stop()
    finally:
        keep_alive.close()


def app_for(service: ManagerService, **settings: Any) -> FastAPI:
    """The app around `service`, with these API settings (token, bind, max_body_bytes...)."""
    return create_app(Settings(state_dir=service.paths.state_dir, **settings), service=service)


@dataclass(frozen=True)
class StreamStart:
    """The start of an endless response: its status, headers and first event (or whole body)."""

    status: int
    headers: Mapping[str, str]
    first_event: str

    def event_data(self) -> dict[str, Any]:
        """The JSON of the first event's `data:` line."""
        line = next(line for line in self.first_event.splitlines() if line.startswith("data: "))
        data: dict[str, Any] = json.loads(line.removeprefix("data: "))
        return data


def read_stream_start(app: FastAPI, path: str, *, headers: Mapping[str, str] | None = None, query: str = "",
                      host: str = "127.0.0.1:8080", timeout_s: float = 10.0) -> StreamStart:
    """GET `path` in process (with this Host header) and hang up after the first server-sent
    event (or at the end of a body that ends), all within `timeout_s`. TestClient would wait for
    an endless stream to end."""

    async def run() -> StreamStart:
        got_event = asyncio.Event()
        request_sent = False
        start: dict[str, Any] = {}
        body = bytearray()

        async def receive() -> Message:
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await got_event.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                start["status"] = message["status"]
                start["headers"] = {k.decode("latin-1"): v.decode("latin-1") for k, v in message["headers"]}
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if b"\n\n" in body or not message.get("more_body", False):
                    got_event.set()

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode(),
            "headers": [(b"host", host.encode("latin-1"))]
                       + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()],
            "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80), "state": {},
        }
        app_done = asyncio.ensure_future(app(scope, receive, send))
        try:
            await asyncio.wait_for(got_event.wait(), timeout_s)
            await asyncio.wait_for(app_done, timeout_s)  # the app notices the hang-up and ends
        finally:
            app_done.cancel()
        text = bytes(body).decode()
        return StreamStart(status=start["status"], headers=start["headers"], first_event=text.split("\n\n")[0])

    return asyncio.run(run())
