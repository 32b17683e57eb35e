"""Helpers of the fault tests (tests/integration/test_faults.py, test_host_failures.py): the
API's view of instance pgc-01, a writer that follows its primary, waits for repairs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pgcarve.control.fleet import Fleet
from pgcarve.postgres.session import CLIENT_DATABASE
from psycopg.conninfo import make_conninfo

from tests.integration.conftest import CarveEnv, wait_for
from tests.integration.writer import AckedWriter

INSTANCE = "pgc-01"


@pytest.fixture()
def fleet(carve_env: CarveEnv) -> Iterator[Fleet]:
    f = Fleet(carve_env.config, carve_env.paths)
    yield f
    f.close()


def api_get(env: CarveEnv, path: str) -> Any:
    with env.client() as client:
        resp = client.get(path)
        assert resp.status_code == 200, resp.text
        return resp.json()


def writer_for(env: CarveEnv, fleet: Fleet) -> AckedWriter:
    """A writer that connects wherever the API says the instance's primary is."""
    password = fleet.credentials.admin_password

    def dsn() -> str | None:
        try:
            doc = api_get(env, f"/v1/instances/{INSTANCE}")
        except Exception:
            return None
        return make_conninfo(doc["dsn"], password=password) if doc.get("dsn") else None

    return AckedWriter(dsn)


def check_nothing_lost(fleet: Fleet, writer: AckedWriter) -> None:
    inst = fleet.instance(INSTANCE)
    assert inst.primary is not None
    with fleet.connect(inst.primary, database=CLIENT_DATABASE) as conn:
        missing = writer.missing(conn)
    print(f"writer {writer.writer_id}: {len(writer.acked)} commits acknowledged, {len(missing)} missing, "
          f"{len(writer.errors)} failed attempts")
    assert len(writer.acked) > 0
    assert missing == [], f"acknowledged commits lost: {missing[:20]}"


def incidents_for(env: CarveEnv, guest: str, since: float) -> list[dict[str, Any]]:
    return [i for i in api_get(env, "/v1/incidents") if i["guest"] == guest and i["detected_at"] >= since - 1]


def wait_recovered(env: CarveEnv, guest: str, since: float, timeout_s: float = 600) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        found = incidents_for(env, guest, since)
        return next((i for i in found if i["status"] == "recovered"), None)

    return wait_for(done, f"recovery of {guest}", timeout_s)


def wait_whole(env: CarveEnv, timeout_s: float = 600) -> dict[str, Any]:
    """Until the instance's primary accepts writes and both standbys stream."""
    def whole() -> dict[str, Any] | None:
        doc = api_get(env, f"/v1/instances/{INSTANCE}")
        streaming = [s for s in doc["standbys"] if s["state"] == "streaming"]
        return doc if doc["writes"] == "accepted" and len(streaming) == 2 else None

    return wait_for(whole, f"{INSTANCE} whole again (writes accepted, 2 standbys streaming)", timeout_s)


def wait_watching(env: CarveEnv) -> None:
    wait_for(lambda: all(h["watching_events"] for h in api_get(env, "/v1/hosts")),
             "the manager to watch every host's lifecycle events", 60)


