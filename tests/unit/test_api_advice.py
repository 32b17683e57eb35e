"""POST /v1/advice and the kept runs, on libvirt's test driver (no guest boots): refused before
anything is queued, runs kept with their report, the runner registered on the operation queue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pgcarve.control.service import ManagerService
from pgcarve_api.advice_runs import KIND, AdviceStore, request_of

from tests.support.api import app_for, service_on_test_driver
from tests.unit.test_advice_report import recorded

TOKEN = "unit-test-token-0123456789abcdef0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[TestClient, ManagerService]]:
    with (service_on_test_driver(tmp_path) as service,
          TestClient(app_for(service, token=TOKEN), base_url="http://127.0.0.1:8080") as client):
        yield client, service


@pytest.mark.parametrize("body", [{"seconds": 3}, {"repeat": 0}, {"max_instances": 1}, {"clients": 0},
                                  {"image": "/tmp/x"}, {"seconds": "30"}, {"host": "H!"}])
def test_bad_bodies_are_422_and_queue_nothing(api: tuple[TestClient, ManagerService], body: object) -> None:
    client, service = api
    assert client.post("/v1/advice", json=body, headers=AUTH).status_code == 422
    assert service.operations.all() == []


def test_requests_the_hosts_cannot_serve_are_refused_before_anything_is_queued(
        api: tuple[TestClient, ManagerService]) -> None:
    client, service = api
    assert client.post("/v1/advice", json={}).status_code == 401
    resp = client.post("/v1/advice", json={}, headers=AUTH)  # one host, no standby host
    assert resp.status_code == 422 and "no host with role: standby" in resp.json()["detail"], resp.text
    assert client.post("/v1/advice", json={"host": "h9"}, headers=AUTH).status_code == 422
    assert service.operations.all() == []


def test_runs_are_kept_with_their_report(api: tuple[TestClient, ManagerService]) -> None:
    client, service = api
    assert KIND in service.operations.runners, "the advice runner is registered on the operation queue"
    assert client.get("/v1/advice").json() == []
    assert client.get("/v1/advice/0123456789ab").status_code == 404
    assert client.get("/v1/advice/..%2Fsecrets").status_code == 404
    AdviceStore(service.paths.state_dir / "advice").save("0123456789ab", {**recorded(), "finished_at": "then"})
    listed = client.get("/v1/advice").json()
    assert [(r["id"], r["word"], r["headline"]) for r in listed] == [
        ("0123456789ab", "helps", "carving helps, 8 guests, 2.7x")]
    assert listed[0]["report"] == "/v1/advice/0123456789ab/report"
    assert client.get("/v1/advice/0123456789ab").json()["verdict"]["word"] == "helps"
    page = client.get("/v1/advice/0123456789ab/report")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "carving helps, 8 guests, 2.7x" in page.text


def test_an_operations_params_come_back_as_the_request() -> None:
    request = request_of({"host": "db1", "max_instances": 4, "seconds": 10, "repeat": 2, "clients": None,
                          "spare": True})
    assert (request.host, request.max_instances, request.seconds, request.repeat, request.spare) == \
        ("db1", 4, 10, 2, True)
    assert request.image_dir is None
