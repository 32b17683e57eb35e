"""GET /v1/instances is built and encoded once per change, not once per request (issue 16): the
same documents while nothing changed, new ones as soon as the view does."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from pgcarve_api.schemas import InstanceOut

from tests.support.api import app_for, service_on_test_driver

TOKEN = "unit-test-token-0123456789abcdef0123"


def test_documents_are_shared_until_the_view_changes(tmp_path: Path) -> None:
    with service_on_test_driver(tmp_path, refresh_s=3600) as service:
        first = service.instance_docs()
        assert service.instance_docs() is first
        assert [d["name"] for d in first] == ["pgc-01", "pgc-02", "pgc-03"]
        service.refresh()
        again = service.instance_docs()
        assert again is not first and again == first


def test_listing_follows_a_scale_down_and_keeps_its_contract(tmp_path: Path) -> None:
    with (service_on_test_driver(tmp_path, refresh_s=3600) as service,
          TestClient(app_for(service, token=TOKEN), base_url="http://127.0.0.1:8080") as client):
        one = client.get("/v1/instances")
        two = client.get("/v1/instances")
        assert one.status_code == 200 and one.headers["content-type"] == "application/json"
        assert one.content == two.content and [d["name"] for d in one.json()] == ["pgc-01", "pgc-02", "pgc-03"]
        # Every field of the public model is there, defaults included, as FastAPI would render it.
        assert set(one.json()[0]) == set(InstanceOut.model_fields)
        resp = client.put("/v1/scale", json={"instances": 1}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status_code == 202
        assert service.wait_idle(30)
        assert [d["name"] for d in client.get("/v1/instances").json()] == ["pgc-01"]
