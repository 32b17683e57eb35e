"""Helpers of the fault tests (tests/integration/test_faults.py, test_host_failures.py): the
API's view of instance pgc-01, a writer that follows its primary through the instance's rw
endpoint, waits for repairs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pgcarve.control.fleet import Fleet
from pgcarve.postgres.session import APP_DATABASE
from psycopg.conninfo import make_conninfo

from tests.integration.conftest import IT_STATE, TOKEN, CarveEnv, wait_for
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


def pgcarve_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """The command line as an operator runs it against the series' server (found through its
    server.json in the state directory)."""
    env = dict(os.environ, PGCARVE_STATE_DIR=str(IT_STATE), PGCARVE_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "pgcarve.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def rw_endpoint(env: CarveEnv) -> str:
    """The instance's rw URI as an application gets it (endpoints from GET /v1/instances, the
    password from the credentials route), with the password filled in."""
    doc = wait_for(lambda: (d := api_get(env, f"/v1/instances/{INSTANCE}")) and d.get("endpoints") and d,
                   f"{INSTANCE}'s endpoints", 300)
    password = api_get(env, f"/v1/instances/{INSTANCE}/credentials")["password"]
    return make_conninfo(doc["endpoints"]["rw"], password=password)


def writer_for(env: CarveEnv, fleet: Fleet) -> AckedWriter:
    """A writer that connects as the application through the instance's rw endpoint: one string,
    taken before the fault and never asked for again, which must reach whichever guest is the
    primary after a restart, a failover or a switchover (libpq tries each guest and keeps the one
    that accepts writes)."""
    uri = rw_endpoint(env)
    return AckedWriter(lambda: uri, ca_file=env.paths.tls_dir / "ca.pem")


def check_nothing_lost(fleet: Fleet, writer: AckedWriter) -> None:
    inst = fleet.instance(INSTANCE)
    assert inst.primary is not None
    with fleet.connect(inst.primary, database=APP_DATABASE) as conn:
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

    try:
        return wait_for(done, f"recovery of {guest}", timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{recovery_story(env, guest, since)}") from None


def recovery_story(env: CarveEnv, guest: str, since: float, lines: int = 40) -> str:
    """What the manager said about `guest` since `since`: its incidents and its log lines."""
    incidents = "\n".join(f"  incident {i['id']}: {i['status']} after {i.get('attempts', '?')} attempt(s), "
                          f"{i['what']}: {i.get('message') or '-'}" for i in incidents_for(env, guest, since))
    log_file = IT_STATE / "server.log"
    said = [line for line in log_file.read_text(errors="replace").splitlines() if guest in line] \
        if log_file.exists() else []
    return (f"incidents of {guest}:\n{incidents or '  none'}\n"
            f"last {lines} lines of {log_file} naming {guest}:\n" + "\n".join(said[-lines:]))


def wait_whole(env: CarveEnv, timeout_s: float = 600) -> dict[str, Any]:
    """Until the instance's primary accepts writes and both standbys stream, one of them as a
    synchronous standby (PostgreSQL shows a standby as 'async' until its first flush report)."""
    def whole() -> dict[str, Any] | None:
        doc = api_get(env, f"/v1/instances/{INSTANCE}")
        streaming = [s for s in doc["standbys"] if s["state"] == "streaming"]
        synchronous = [s for s in streaming if s["sync_state"] in ("sync", "quorum")]
        return doc if doc["writes"] == "accepted" and len(streaming) == 2 and synchronous else None

    return wait_for(whole, f"{INSTANCE} whole again (writes accepted, 2 standbys streaming, one synchronous)",
                    timeout_s)


def wait_watching(env: CarveEnv) -> None:
    wait_for(lambda: all(h["watching_events"] for h in api_get(env, "/v1/hosts")),
             "the manager to watch every host's lifecycle events", 60)


