"""`pgcarve load`'s reading of the API (cli/client.py): client transactions counted during a pgbench run."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from pgcarve.cli.client import ApiClient


@pytest.fixture()
def history_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback server answering /v1/tps/history with whatever the test puts in the list."""
    points: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            # /v1/tps is the newest point; /v1/tps/history all of them.
            latest = points[-1] if points else {"instances": {}}
            body = json.dumps(points if self.path.startswith("/v1/tps/history") else latest).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", points
    finally:
        server.shutdown()
        server.server_close()


def test_difference_of_totals_between_the_samples_around_the_run(
        history_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, points = history_server
    points += [
        {"at": 98.0, "aggregate_tps": 500.0, "window_s": 1.0, "xacts_total": 900},
        {"at": 99.5, "aggregate_tps": 0.0, "window_s": 1.0, "xacts_total": 1000},   # last before the run
        {"at": 101.0, "aggregate_tps": 10.0, "window_s": 1.0, "xacts_total": 1010},
        # A late poll: the previous rate stood one more second, so integrating rates would
        # count 20 twice; the totals count every transaction once.
        {"at": 102.0, "aggregate_tps": 10.0, "window_s": 1.0, "xacts_total": 1010},
        {"at": 103.0, "aggregate_tps": 20.0, "window_s": 2.0, "xacts_total": 1050},
        {"at": 104.0, "aggregate_tps": 30.0, "window_s": 1.0, "xacts_total": 1080},
        {"at": 108.0, "aggregate_tps": 0.0, "window_s": 1.0, "xacts_total": 1081},  # first idle, 3 s after
        {"at": 109.0, "aggregate_tps": 7.0, "window_s": 1.0, "xacts_total": 1088},   # later work: not counted
    ]
    assert ApiClient(url).transactions_during(100.0, 105.0, wait_s=1) == 81


def test_none_when_no_sample_arrives_after_the_run(history_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, points = history_server
    points += [{"at": 99.0, "aggregate_tps": 0.0, "window_s": 1.0, "xacts_total": 5},
               {"at": 101.0, "aggregate_tps": 10.0, "window_s": 1.0, "xacts_total": 15}]
    assert ApiClient(url).transactions_during(100.0, 105.0, wait_s=0.6) is None


def test_none_when_the_history_does_not_reach_back_to_the_start(
        history_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, points = history_server
    points += [{"at": 101.0, "aggregate_tps": 10.0, "window_s": 1.0, "xacts_total": 15},
               {"at": 109.0, "aggregate_tps": 0.0, "window_s": 1.0, "xacts_total": 25}]
    assert ApiClient(url).transactions_during(100.0, 105.0, wait_s=5) is None


def test_no_count_when_an_instance_had_no_baseline_before_the_run(
        history_server: tuple[str, list[dict[str, Any]]]) -> None:
    """The collector first sampled pgc-02 after the load began: its first commits are in no
    difference of totals, so the API offers no figure rather than one short by them."""
    url, points = history_server
    points += [{"at": 99.0, "xacts_total": 5, "instances": {"pgc-01": {}}},
               {"at": 101.0, "xacts_total": 15, "instances": {"pgc-01": {}, "pgc-02": {}}},
               {"at": 109.0, "xacts_total": 95, "instances": {"pgc-01": {}, "pgc-02": {}}}]
    client = ApiClient(url)
    assert client.transactions_during(100.0, 105.0, wait_s=1, instances=("pgc-01", "pgc-02")) is None
    assert client.transactions_during(100.0, 105.0, wait_s=1, instances=("pgc-01",)) == 90


def test_waits_until_every_instance_has_a_baseline(history_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, points = history_server
    points.append({"at": 99.0, "xacts_total": 5, "instances": {"pgc-01": {}}})
    client = ApiClient(url)
    assert client.wait_until_sampled(["pgc-01", "pgc-02"], wait_s=0.6) == ["pgc-02"]
    points.append({"at": 100.0, "xacts_total": 6, "instances": {"pgc-01": {}, "pgc-02": {}}})
    assert client.wait_until_sampled(["pgc-01", "pgc-02"], wait_s=0.6) == []


def test_waits_for_samples_newer_than_the_last_writes(history_server: tuple[str, list[dict[str, Any]]]) -> None:
    """pgc-02 last answered the collector before the writes that came just ahead of the load: a
    baseline that old would count those writes with the load."""
    url, points = history_server
    points.append({"at": 120.0, "xacts_total": 5, "instances": {"pgc-01": {"sampled_at": 119.5},
                                                                "pgc-02": {"sampled_at": 90.0}}})
    client = ApiClient(url)
    assert client.wait_until_sampled(["pgc-01", "pgc-02"], wait_s=0.6, since=110.0) == ["pgc-02"]
    points.append({"at": 121.0, "xacts_total": 9, "instances": {"pgc-01": {"sampled_at": 120.5},
                                                                "pgc-02": {"sampled_at": 121.0}}})
    assert client.wait_until_sampled(["pgc-01", "pgc-02"], wait_s=0.6, since=110.0) == []


def test_the_count_waits_for_every_instance_to_be_polled_after_the_run(
        history_server: tuple[str, list[dict[str, Any]]]) -> None:
    """pgc-01 was too busy to answer the collector when the load ended: the first samples after
    the run still hold its count from before; the figure comes from the first sample with both."""
    url, points = history_server

    def point(at: float, total: int, a: float, b: float) -> dict[str, Any]:
        return {"at": at, "xacts_total": total, "instances": {"pgc-01": {"sampled_at": a}, "pgc-02": {"sampled_at": b}}}

    points += [point(99.0, 5, 99.0, 99.0),
               point(108.0, 60, 101.0, 108.0),   # pgc-01 last answered during the run
               point(109.0, 61, 101.0, 109.0),
               point(112.0, 95, 111.5, 112.0)]   # both polled after the run settled
    assert ApiClient(url).transactions_during(100.0, 105.0, wait_s=1, instances=("pgc-01", "pgc-02")) == 90
    points.pop()
    assert ApiClient(url).transactions_during(100.0, 105.0, wait_s=0.6, instances=("pgc-01", "pgc-02")) is None
