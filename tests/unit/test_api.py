"""The REST contract on libvirt's test driver: auth, bad input, capacity, scale-down order,
serialized concurrent scales, oversized bodies. No guest boots here."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pgcarve.control.operations import Operation
from pgcarve.control.scaler import plan_scale
from pgcarve.control.service import ManagerService

from tests.support.api import app_for, service_on_test_driver

TOKEN = "unit-test-token-0123456789abcdef0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[TestClient, ManagerService]]:
    with (service_on_test_driver(tmp_path) as service,
          TestClient(app_for(service, token=TOKEN), base_url="http://127.0.0.1:8080") as client):
        yield client, service


def test_reads(api: tuple[TestClient, ManagerService]) -> None:
    client, _ = api
    health = client.get("/healthz").json()
    assert {k: health[k] for k in ("status", "ha_loop", "role")} == {"status": "ok", "ha_loop": "off",
                                                                    "role": "leader"}  # supervise=False here
    assert "no etcd section" in health["leadership"]["lease"]  # alone: today's flock, said so
    hosts = client.get("/v1/hosts").json()
    assert hosts[0]["name"] == "h1" and hosts[0]["instances"] == 3 and hosts[0]["cpus"] > 0
    names = [i["name"] for i in client.get("/v1/instances").json()]
    assert names == ["pgc-01", "pgc-02", "pgc-03"]
    one = client.get("/v1/instances/pgc-02").json()
    assert one["vcpus"] == [2] and one["standbys"] == []
    assert client.get("/v1/instances/pgc-09").status_code == 404
    plan = client.get("/v1/plan", params={"instances": 2}).json()
    assert len(plan[0]["slots"]) == 2 and "explanation" in plan[0]
    assert client.get("/v1/plan", params={"instances": -1}).status_code == 422
    tps = client.get("/v1/tps").json()
    assert set(tps) == {"aggregate_tps", "aggregate_qps", "window_s", "at", "instances", "xacts_total",
                        "statements_total"}
    assert "pgcarve_instances 3.0" in client.get("/metrics").text
    assert client.get("/openapi.json").json()["paths"]["/v1/scale"]
    assert client.get("/").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_mutations_need_the_token(api: tuple[TestClient, ManagerService], headers: dict[str, str]) -> None:
    client, service = api
    resp = client.put("/v1/scale", json={"instances": 1}, headers=headers)
    assert resp.status_code == 401
    assert service.operations.all() == []


@pytest.mark.parametrize("body", [{"instances": -1}, {"instances": "2"}, {"instances": 1.5}, {}, {"n": 1},
                                  {"instances": 1, "extra": True}, [1]])
def test_bad_bodies_are_422_and_change_nothing(api: tuple[TestClient, ManagerService], body: object) -> None:
    client, service = api
    assert client.put("/v1/scale", json=body, headers=AUTH).status_code == 422
    assert service.operations.all() == []


def test_above_capacity_is_409_naming_the_limit(api: tuple[TestClient, ManagerService]) -> None:
    client, service = api
    capacity = service.fleet.placement.capacity()
    resp = client.put("/v1/scale", json={"instances": capacity + 1}, headers=AUTH)
    assert resp.status_code == 409
    assert f"room for {capacity}" in resp.json()["detail"]
    assert service.operations.all() == []


def test_oversized_body_is_refused(api: tuple[TestClient, ManagerService]) -> None:
    client, _ = api
    resp = client.put("/v1/scale", content=b"{" + b" " * (70 * 1024) + b"}",
                      headers={**AUTH, "content-type": "application/json"})
    assert resp.status_code == 413


def test_scale_down_removes_highest_numbered(api: tuple[TestClient, ManagerService]) -> None:
    client, service = api
    resp = client.put("/v1/scale", json={"instances": 1}, headers=AUTH)
    assert resp.status_code == 202
    op_id = resp.json()["operation"]
    assert service.wait_idle(30)
    op = client.get(f"/v1/operations/{op_id}").json()
    assert op["status"] == "succeeded", op
    assert op["progress"] == 1.0
    assert op["message"] == "created 0, brought back 0 from retirement, retired 2 (disks kept)", op
    assert [i["name"] for i in client.get("/v1/instances").json()] == ["pgc-01"]


def test_failed_scale_up_reports_why(api: tuple[TestClient, ManagerService]) -> None:
    client, service = api
    op_id = client.put("/v1/scale", json={"instances": 4}, headers=AUTH).json()["operation"]
    assert service.wait_idle(30)
    op = client.get(f"/v1/operations/{op_id}").json()
    assert op["status"] == "failed" and "no guest image" in op["error"]
    assert len(client.get("/v1/instances").json()) == 3, "a failed scale-up must not remove anything"


def test_concurrent_scales_are_serialized_and_the_last_wins(api: tuple[TestClient, ManagerService]) -> None:
    client, service = api
    targets = [3, 2, 3, 1, 2, 3, 2, 1, 3, 2, 1, 2, 3, 1, 2, 3, 2, 1, 2, 1]
    accepted: list[tuple[float, str, int]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(targets))

    def put(target: int) -> None:
        barrier.wait()
        resp = client.put("/v1/scale", json={"instances": target}, headers=AUTH)
        assert resp.status_code == 202
        with lock:
            op = service.operations.get(resp.json()["operation"])
            assert op is not None
            accepted.append((op.seq, op.id, target))

    threads = [threading.Thread(target=put, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert service.wait_idle(60)
    ops = service.operations.all()
    assert len(ops) == 20
    ran = sorted((op for op in ops if op.started_at is not None), key=lambda op: op.started_at or 0.0)
    assert ran and ran[-1].id == max(accepted)[1], "the last accepted request must run"
    assert ran == sorted(ran, key=lambda op: op.seq), "a newer request ran before an older one"
    for op in ops:
        if op.started_at is None:
            assert op.status == "failed" and "superseded" in (op.error or ""), op
    # Which way each operation that ran had to end follows from the count before it: a scale-down
    # (or no change) succeeds; a scale-up fails, as nothing can be created without a guest image
    # (nor brought back from retirement: the test driver's guests have no disks to keep), and
    # removes nothing.
    count = 3
    for op in ran:
        assert_scale_outcome(op, count)
        count = op.target if op.target <= count else count
    assert len(client.get("/v1/instances").json()) == count


def assert_scale_outcome(op: Operation, before: int) -> None:
    if op.target <= before:
        assert op.status == "succeeded", op
    else:
        assert op.status == "failed", op
        assert "no guest image" in (op.error or "") or "kept disks" in (op.error or ""), op


def test_plan_scale() -> None:
    class Inst:
        def __init__(self, index: int) -> None:
            self.index = index

    plan = plan_scale([Inst(1), Inst(2), Inst(5)], 3)  # type: ignore[list-item]
    assert plan.create == (3,) and plan.retire == (5,) and plan.revive == ()
    # Retired instances come back in their own slots; only slots with nothing retired are new.
    plan = plan_scale([Inst(1)], 4, retired=(3, 5))  # type: ignore[list-item]
    assert plan.revive == (3,) and plan.create == (2, 4) and plan.retire == ()
    assert plan_scale([], 0).create == ()


def test_token_file_is_private(tmp_path: Path) -> None:
    from pgcarve_api.security import load_or_create_token, token_matches

    token, created = load_or_create_token(None, tmp_path / "api-token")
    assert created and len(token) >= 32
    assert os.stat(tmp_path / "api-token").st_mode & 0o777 == 0o600
    assert load_or_create_token(None, tmp_path / "api-token") == (token, False)
    assert token_matches(token, token) and not token_matches(token[:-1], token) and not token_matches(None, token)
