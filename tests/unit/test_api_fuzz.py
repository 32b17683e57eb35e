"""Property-based fuzzing of the OpenAPI contract (schemathesis): no input makes a server error,
with or without the token. Runs against the real app on libvirt's test driver."""

from __future__ import annotations

from pathlib import Path

import libvirt
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pgcarve.config import FleetConfig, HostConfig, Replication
from pgcarve.control.service import ManagerService
from pgcarve.settings import Paths
from pgcarve_api.main import create_app
from pgcarve_api.settings import Settings

TOKEN = "fuzz-token-0123456789abcdef0123456789"


def build_app(state: Path) -> object:
    config = FleetConfig(hosts=[HostConfig(name="h1", uri="test:///default", role="primary")],
                         replication=Replication(standbys=0))
    service = ManagerService(config, Paths(state), refresh_s=0.5, collect=False, supervise=False)
    service.start()
    # schemathesis's ASGI client sends Host: testserver; the server is told that name, as an
    # operator would with PGCARVE_ALLOWED_HOSTS.
    return create_app(Settings(state_dir=state, token=TOKEN, allowed_hosts="testserver"), service=service)


_keep_alive = libvirt.open("test:///default")
_state = Path(__import__("tempfile").mkdtemp(prefix="pgcarve-fuzz-"))
schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(_state))


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCARVE_IMAGE_DIR", str(_state / "no-image"))
    if case.path == "/v1/events":
        return  # an endless stream; covered by the browser test
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    anonymous = case.call()
    assert anonymous.status_code < 500
    if case.method.upper() == "PUT":
        assert anonymous.status_code not in (200, 202), "a mutation went through without the token"
