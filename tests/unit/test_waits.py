"""What client sessions wait on: pg_stat_activity rows into categories, samples into shares, and
the API's view of it on libvirt's test driver (no PostgreSQL answers there: sampling is off)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from pgcarve.control import waits
from pgcarve.control.collector import Target
from pgcarve.control.service import ManagerService
from pgcarve.control.waits import WaitSampler, _Feed, breakdown_of
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
        assert doc["error"] == "sampling is off (PGCARVE_COLLECT=0: nothing is polled)"
        assert doc["summary"].startswith("not sampled")
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
        await sampler._reconcile()
        seen.append(set(sampler._feeds))
        assert sampler.breakdown("pgc-01") is None  # asking starts it
        await sampler._reconcile()
        seen.append(set(sampler._feeds))
        now[0] += 100
        sampler.breakdown("pgc-01")  # asked again: 120 s more
        now[0] += 100
        await sampler._reconcile()
        seen.append(set(sampler._feeds))
        now[0] += 21
        await sampler._reconcile()
        seen.append(set(sampler._feeds))
        await sampler.aclose()
        return seen

    assert asyncio.run(scenario()) == [set(), {"pgc-01"}, {"pgc-01"}, set()]
    assert WaitSampler(lambda: targets).on_demand_s is None  # the bench's: every target, always


def test_summary_says_how_long_the_samples_cover() -> None:
    """On demand, sampling may have begun seconds ago: the summary says so, not the whole window."""
    now = [1000.0]
    target = Target(instance="pgc-01", host="h0", dsn="")
    sampler = WaitSampler(lambda: [target], window_s=30, clock=lambda: now[0])
    feed = _Feed(target, 0.2)
    feed.samples.extend([(997.0, {"SyncRep": 3}), (999.0, {"SyncRep": 1, "client": 1})])
    sampler._feeds["pgc-01"] = feed
    assert sampler.breakdown("pgc-01").summary().endswith("over 2 samples in 3.0 s")  # type: ignore[union-attr]
    now[0] = 1025.0
    assert sampler.breakdown("pgc-01").summary().endswith("over 2 samples in 28 s")  # type: ignore[union-attr]
    assert breakdown_of("x", [{"CPU": 1}], 30).summary().endswith("over 1 sample in 30 s")


class FakeSession:
    """Stands in for a psycopg session: answers with no client session at all."""

    def __init__(self) -> None:
        self.closed = False

    async def execute(self, *_args: Any) -> FakeSession:
        return self

    async def fetchall(self) -> list[tuple[object, ...]]:
        return []

    async def close(self) -> None:
        self.closed = True


class FakeSampler(WaitSampler):
    """A WaitSampler whose sessions are FakeSessions, and whose first `fail` samples raise."""

    def __init__(self, *args: Any, fail: list[BaseException] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: list[FakeSession] = []
        self.fail = fail or []

    async def _connect(self, target: Target) -> Any:
        self.sessions.append(FakeSession())
        return self.sessions[-1]

    async def sample(self, feed: _Feed) -> None:
        if self.fail:
            await super().sample(feed)  # connects first, like a real failure half-way
            raise self.fail.pop(0)
        await super().sample(feed)


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_an_unforeseen_error_does_not_stop_sampling(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Not only a lost session: any error (a driver bug, an odd row) closes the session and a
    later tick opens a new one; a dead sampling task would leave the instance unsampled for good."""
    monkeypatch.setattr(waits, "_RECONNECT_S", 0.01)
    target = Target(instance="pgc-01", host="h0", dsn="")
    sampler = FakeSampler(lambda: [target], rate_hz=50, fail=[KeyError("state")])

    async def scenario() -> None:
        await sampler._reconcile()
        await _until(lambda: len(sampler.sessions) == 2 and sampler._feeds["pgc-01"].samples)
        assert sampler.sessions[0].closed and not sampler.sessions[1].closed
        assert sampler._feeds["pgc-01"].error is None  # the next good sample clears it
        await sampler.aclose()
        assert sampler.sessions[1].closed

    with caplog.at_level(logging.WARNING, logger=waits.__name__):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records] == [
        "pgc-01: sampling PostgreSQL on h0 failed: 'state'; trying again in 0.01 s"]


def test_a_feed_no_longer_wanted_is_closed_before_reconcile_returns() -> None:
    """Its session is closed by the time _reconcile returns, not whenever its task gets to run:
    otherwise the last ones could still be open when the event loop closes."""
    now = [1000.0]
    target = Target(instance="pgc-01", host="h0", dsn="")
    sampler = FakeSampler(lambda: [target], rate_hz=50, on_demand_s=10, clock=lambda: now[0])

    async def scenario() -> None:
        sampler.watch("pgc-01")
        await sampler._reconcile()
        await _until(lambda: sampler.sessions)
        now[0] += 11  # nobody asked for 11 s
        await sampler._reconcile()
        assert sampler._feeds == {} and sampler.sessions[0].closed

    asyncio.run(scenario())


def test_the_collector_is_stopped_before_its_sessions_are_closed() -> None:
    """If the wait sampler fails, the collector is cancelled and awaited before run_collector
    closes its sessions (asyncio.gather left it running on closed sessions)."""
    events: list[str] = []

    class Collector:
        async def run(self, stop: asyncio.Event) -> None:
            try:
                await stop.wait()
            finally:
                events.append("collector stopped")

        async def aclose(self) -> None:
            events.append("sessions closed")

    class BrokenSampler:
        async def run(self, stop: asyncio.Event) -> None:
            await asyncio.sleep(0)
            raise RuntimeError("broken")

    service = SimpleNamespace(collector=Collector(), waits=BrokenSampler())
    with pytest.raises(ExceptionGroup):
        asyncio.run(ManagerService.run_collector(service, asyncio.Event()))  # type: ignore[arg-type]
    assert events == ["collector stopped", "sessions closed"]
