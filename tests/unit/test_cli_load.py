"""`pgcarve load`'s reading of the API: transactions counted during a pgbench run."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from pgcarve.cli import api_transactions_during


@pytest.fixture()
def history_server() -> Iterator[tuple[str, list[dict[str, float]]]]:
    """A loopback server answering /v1/tps/history with whatever the test puts in the list."""
    points: list[dict[str, float]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(points).encode()
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


def run(started: float, finished: float) -> SimpleNamespace:
    return SimpleNamespace(started_at=started, finished_at=finished)


def test_integral_of_rates_over_their_own_intervals(history_server: tuple[str, list[dict[str, float]]]) -> None:
    url, points = history_server
    points += [
        {"at": 99.0, "aggregate_tps": 500.0, "window_s": 1.0},   # before the run: not counted
        {"at": 101.0, "aggregate_tps": 10.0, "window_s": 1.0},
        {"at": 103.0, "aggregate_tps": 20.0, "window_s": 2.0},   # a late poll covers 2 s
        {"at": 104.0, "aggregate_tps": 30.0, "window_s": 1.0},
        {"at": 108.0, "aggregate_tps": 0.0, "window_s": 1.0},    # idle, 3 s after the end
    ]
    counted = api_transactions_during(url, [run(100.0, 104.5), run(100.2, 105.0)], wait_s=1)
    assert counted == pytest.approx(10 + 40 + 30)


def test_none_when_no_sample_arrives_after_the_run(history_server: tuple[str, list[dict[str, float]]]) -> None:
    url, points = history_server
    points.append({"at": 101.0, "aggregate_tps": 10.0, "window_s": 1.0})
    assert api_transactions_during(url, [run(100.0, 105.0)], wait_s=0.6) is None
