"""The guest watchdog's session to PostgreSQL (images/rootfs/usr/local/sbin/pgcarve-watchdog): one
psql kept open between ticks, started afresh after it ends, errs or hangs. psql is replaced by a
small script that answers like `psql -A -t` and records each start."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.guest_script import load_guest_script

FAKE_PSQL = """
import sys
open(sys.argv[1], "a").write("started\\n")
mode = sys.argv[2]
for n, line in enumerate(sys.stdin):
    if mode == "error":
        print("ERROR:  relation does not exist", file=sys.stderr, flush=True)
    elif mode == "hang":
        continue
    else:
        print(f"f {n + 1}", flush=True)
    if mode == "once":
        break
"""


def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
            answer_timeout_s: float = 10.0) -> tuple[ModuleType, Path]:
    """The watchdog with its psql replaced. The answer timeout also covers starting the fake's
    Python, which a loaded machine can make slow: only the hanging fake gets a short one."""
    watchdog = load_guest_script("pgcarve-watchdog")
    script, starts = tmp_path / "fake_psql.py", tmp_path / "starts"
    script.write_text(FAKE_PSQL)
    monkeypatch.setattr(watchdog, "PSQL", [sys.executable, str(script), str(starts), mode])
    monkeypatch.setattr(watchdog, "PSQL_USER", None)
    monkeypatch.setattr(watchdog, "ANSWER_TIMEOUT_S", answer_timeout_s)
    return watchdog, starts


def test_one_session_answers_every_tick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watchdog, starts = session(tmp_path, monkeypatch, "answer")
    local = watchdog.LocalSession()
    try:
        assert [local.ask() for _ in range(5)] == [(False, n) for n in range(1, 6)]
        assert starts.read_text().count("started") == 1
    finally:
        local.close()


def test_a_session_that_ended_is_opened_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watchdog, starts = session(tmp_path, monkeypatch, "once")
    local = watchdog.LocalSession()
    try:
        assert local.ask() == (False, 1)
        local.proc.wait(timeout=10)  # as psql does when PostgreSQL restarts under it
        assert local.ask() == (False, 1)
        assert starts.read_text().count("started") == 2
    finally:
        local.close()


@pytest.mark.parametrize("mode", ["error", "hang"])
def test_no_answer_is_none_and_the_session_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      mode: str) -> None:
    timeout_s = 2.0 if mode == "hang" else 10.0
    watchdog, starts = session(tmp_path, monkeypatch, mode, timeout_s)
    local = watchdog.LocalSession()
    started = time.monotonic()
    assert local.ask() is None
    # Well past the timeout, not close to it: make test runs this beside booting guests, at a
    # lower priority, where starting and ending the stand-in psql alone can take seconds.
    assert time.monotonic() - started < timeout_s + 20, "ask() waited past its answer timeout"
    assert local.proc is None
    assert local.ask() is None
    assert starts.read_text().count("started") == 2
