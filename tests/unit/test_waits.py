"""What client sessions wait on: pg_stat_activity rows into categories, samples into shares, and
the API's view of it on libvirt's test driver (no PostgreSQL answers there: sampling is off)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from pgcarve.control.collector import Target
from pgcarve.control.waits import WaitSampler, breakdown_of
from pgcarve.postgres.statistics import WAIT_CATEGORIES, WAIT_MEANING, wait_category, wait_counts

from tests.support.api import app_for, service_on_test_driver


@pytest.mark.parametrize(("state", "wait_type", "event", "category"), [
    ("active", "IPC", "SyncRep", "SyncRep"),
    ("active", "LWLock", "WALWrite", "WAL write"),
    ("active", "IO", "WALSync", "WAL write"),
    ("active", "IO", "WALWrite", "WAL write"),
    ("active", "LWLock", "WALInsert", "WAL insert"),
    ("active", "LWLock", "WALBufMapping", "WAL insert"),
    ("active", "LWLock", "ProcArray", "other LWLocks"),
    ("active", "IPC", "ProcArrayGroupUpdate", "IPC"),
    ("active", "Lock", "transactionid", "lock"),
    ("active", "IO", "DataFileRead", "IO"),
    ("idle", "Client", "ClientRead", "client"),
    ("active", "Client", "ClientWrite", "client"),
    ("active", None, None, "CPU"),
    ("active", "Timeout", "PgSleep", "other"),
    ("active", "BufferPin", "BufferPin", "other"),
])
def test_categories(state: str, wait_type: str | None, event: str | None, category: str) -> None:
    assert wait_category(state, wait_type, event) == category


def test_every_category_says_what_it_counts() -> None:
    assert set(WAIT_MEANING) == set(WAIT_CATEGORIES)


def test_counts_and_shares() -> None:
    rows = [("active", "IPC", "SyncRep", 6), ("idle", "Client", "ClientRead", 2), ("active", None, None, 1),
            ("active", "LWLock", "WALWrite", 1)]
    one = wait_counts(rows)
    assert one == {"SyncRep": 6, "client": 2, "CPU": 1, "WAL write": 1}
    found = breakdown_of("pgc-01", [one, {"SyncRep": 10}], window_s=30)
    assert found.samples == 2 and found.sessions == 20
    assert found.shares["SyncRep"] == pytest.approx(0.8) and found.shares["IO"] == 0.0
    assert found.dominant == "SyncRep"
    assert found.summary().startswith("80% of sampled client-session time: SyncRep")
    assert breakdown_of("x", [], 30).summary() == "no sample yet"
    assert breakdown_of("x", [{}], 30).summary() == "no client session in the samples"
    assert breakdown_of("x", [], 30, error="down").summary() == "not sampled: down"


@given(st.lists(st.dictionaries(st.sampled_from(WAIT_CATEGORIES), st.integers(0, 500)), max_size=20))
def test_shares_sum_to_one_whenever_anything_was_seen(samples: list[dict[str, int]]) -> None:
    found = breakdown_of("i", samples, 10)
    assert set(found.shares) == set(WAIT_CATEGORIES)
    assert found.sessions == sum(sum(s.values()) for s in samples)
    assert sum(found.shares.values()) == (pytest.approx(1.0) if found.sessions else 0.0)


def test_sampling_slows_down_with_many_primaries() -> None:
    sampler = WaitSampler(lambda: [], rate_hz=10, max_per_s=100)
    assert sampler.interval_s(1) == pytest.approx(0.1)
    assert sampler.interval_s(10) == pytest.approx(0.1)
    assert sampler.interval_s(256) == pytest.approx(2.56)  # at most 100 statements a second in all


def test_waits_route(tmp_path: Path) -> None:
    with (service_on_test_driver(tmp_path) as service,
          TestClient(app_for(service), base_url="http://127.0.0.1:8080") as client):
        resp = client.get("/v1/instances/pgc-01/waits")
        assert resp.status_code == 200
        doc = resp.json()
        assert doc["instance"] == "pgc-01" and doc["samples"] == 0 and doc["dominant"] is None
        assert set(doc["shares"]) == set(WAIT_CATEGORIES) == set(doc["meaning"])
        assert doc["error"].startswith("sampling is off") and doc["summary"].startswith("not sampled")
        assert client.get("/v1/instances/pgc-99/waits").status_code == 404
        assert "/v1/instances/{name}/waits" in client.get("/openapi.json").json()["paths"]


def test_on_demand_samples_only_instances_someone_asked_for() -> None:
    """The API's sampler: an instance is sampled from the first request for its breakdown until
    on_demand_s after the last one; nobody asking, no statement reaches its primary."""
    now = [1000.0]
    targets = [Target(instance=name, host="h0", dsn="host=127.0.0.1 port=1 dbname=x connect_timeout=1")
               for name in ("pgc-01", "pgc-02")]
    sampler = WaitSampler(lambda: targets, rate_hz=1, on_demand_s=120, clock=lambda: now[0])

    async def scenario() -> list[set[str]]:
        seen = []
        sampler._reconcile()
        seen.append(set(sampler._feeds))
        assert sampler.breakdown("pgc-01") is None  # asking starts it
        sampler._reconcile()
        seen.append(set(sampler._feeds))
        now[0] += 100
        sampler.breakdown("pgc-01")  # asked again: 120 s more
        now[0] += 100
        sampler._reconcile()
        seen.append(set(sampler._feeds))
        now[0] += 21
        sampler._reconcile()
        seen.append(set(sampler._feeds))
        await sampler.aclose()
        return seen

    assert asyncio.run(scenario()) == [set(), {"pgc-01"}, {"pgc-01"}, set()]
    assert WaitSampler(lambda: targets).on_demand_s is None  # the bench's: every target, always
