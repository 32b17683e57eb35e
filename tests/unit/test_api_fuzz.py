"""Property-based fuzzing of the OpenAPI contract (schemathesis): no input makes a server error,
with or without the token. Runs against the real app on libvirt's test driver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from tempfile import gettempdir
from urllib.parse import urlencode

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from pgcarve_api.main import create_app
from pgcarve_api.settings import Settings

from tests.support.api import app_for, read_stream_start, service_on_test_driver

TOKEN = "fuzz-token-0123456789abcdef0123456789"
EVENTS = "/v1/events"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FastAPI]:
    with service_on_test_driver(tmp_path_factory.mktemp("fuzz"), refresh_s=0.5) as service:
        # schemathesis's ASGI client sends Host: testserver; the server is told that name, as an
        # operator would with PGCARVE_ALLOWED_HOSTS.
        yield app_for(service, token=TOKEN, allowed_hosts="testserver")


# The contract alone, from an app that is never started; requests go to the fixture's app.
# (schemathesis.pytest.from_fixture, which would load it from the fixture, fails on pytest 9.)
schema = schemathesis.openapi.from_dict(create_app(Settings(state_dir=Path(gettempdir()), token=TOKEN)).openapi())


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case, app: FastAPI) -> None:
    if case.path == EVENTS:
        check_event_stream(case, app)
        return
    response = case.call(app=app, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    anonymous = case.call(app=app)
    assert anonymous.status_code < 500
    if case.method.upper() == "PUT":
        assert anonymous.status_code not in (200, 202), "a mutation went through without the token"


def check_event_stream(case: schemathesis.Case, app: FastAPI) -> None:
    """The endless stream, with and without the token (reads are open on loopback): 200, and a
    first `tps` event carrying the /v1/tps document within a few seconds; then we hang up."""
    query = urlencode(case.query or {}, doseq=True)
    for headers in ({"Authorization": f"Bearer {TOKEN}"}, {}):
        start = read_stream_start(app, EVENTS, headers={**headers, **dict(case.headers or {})}, query=query,
                                  timeout_s=10)
        assert start.status == 200, start
        assert start.headers["content-type"].startswith("text/event-stream"), start.headers
        assert start.first_event.startswith("event: tps\n"), start.first_event
        data = start.event_data()
        assert {"aggregate_tps", "aggregate_qps", "instances", "instance_count", "operations"} <= set(data), data
        assert isinstance(data["instance_count"], int) and isinstance(data["operations"], list), data
