"""GET /v1/instances is built and encoded once per change, not once per request (issue 16): the
same documents while nothing changed, new ones as soon as the view does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pgcarve_api.routes import instances
from pgcarve_api.schemas import InstanceOut

from tests.support.api import app_for, service_on_test_driver

TOKEN = "unit-test-token-0123456789abcdef0123"


def test_documents_are_shared_until_the_view_changes(tmp_path: Path) -> None:
    with service_on_test_driver(tmp_path, refresh_s=3600) as service:
        first = service.instance_docs()
        assert service.instance_docs() is first
        assert [d["name"] for d in first] == ["pgc-01", "pgc-02", "pgc-03"]
        service.refresh()
        assert service.instance_docs() is first, "a refresh that finds nothing new keeps them"
        with service.fleet.locks.exclusive(2, "reviving"):
            service.refresh()
            again = service.instance_docs()
        assert again is not first and again[1]["state"] == "reviving" and again[0] == first[0]


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


def test_listing_is_built_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documents are built again after every collector round, reading files and taking
    locks: in the threadpool, never on the loop the collector and the wait sampler run on."""
    with (service_on_test_driver(tmp_path, refresh_s=3600) as service,
          TestClient(app_for(service), base_url="http://127.0.0.1:8080") as client):
        built_on_loop = []
        build = service.instance_docs

        def watched(include_retired: bool = False) -> list[dict[str, Any]]:
            try:
                asyncio.get_running_loop()
                built_on_loop.append(True)
            except RuntimeError:  # no loop running in this thread
                built_on_loop.append(False)
            return build(include_retired)

        monkeypatch.setattr(service, "instance_docs", watched)
        assert client.get("/v1/instances").status_code == 200
        assert built_on_loop == [False]


def test_plain_and_retired_listings_keep_an_encoding_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alternating `?include=retired` and plain requests (the dashboard and the CLI side by side)
    encodes each once: one shared slot re-encoded 256 documents on every request."""
    encoded: list[int] = []

    class CountingAdapter:
        def __init__(self, adapter: Any) -> None:
            self.adapter = adapter

        def validate_python(self, docs: Any) -> Any:
            return self.adapter.validate_python(docs)

        def dump_json(self, value: Any) -> bytes:
            encoded.append(len(value))
            return bytes(self.adapter.dump_json(value))

    for listing in instances._listings.values():
        monkeypatch.setattr(listing, "_adapter", CountingAdapter(listing._adapter))
    with (service_on_test_driver(tmp_path, refresh_s=3600) as service,
          TestClient(app_for(service), base_url="http://127.0.0.1:8080") as client):
        bodies = [client.get("/v1/instances", params=params).content
                  for params in ({}, {"include": "retired"}) * 3]
        assert len(encoded) == 2
        assert bodies[0::2] == [bodies[0]] * 3 and bodies[1::2] == [bodies[1]] * 3
