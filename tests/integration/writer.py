"""A writer that remembers every acknowledged commit, for the fault tests.

It inserts numbered rows one transaction at a time, through the DSN it is given (the fault tests
give the instance's rw endpoint, which follows a failover), over TLS verified with the fleet CA, and records a number
only after COMMIT returned without error. After a fault and recovery, `missing()` lists
acknowledged rows the primary does not have: it must be empty. The loop is bounded in rows and
time.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psycopg
from pgcarve.sandbox.forward import join_netns

TABLE = "fault_log"
T = TypeVar("T")


class AckedWriter:
    def __init__(self, dsn: Callable[[], str | None], *, ca_file: Path, max_rows: int = 200_000,
                 max_seconds: float = 1800, pace_s: float = 0.1, netns: Path | None = None):
        """`ca_file`: the fleet CA (<state>/tls/ca.pem), which every connection verifies the server with.
        `netns`: a network namespace the writer's thread joins first (where a manager with
        `reach: direct` runs), so its connections go from there."""
        self.dsn = dsn
        self.netns = netns
        self.ca_file = ca_file
        # A steady trickle, ten commits a second: enough to check, and little CPU taken from booting
        # guests (at 50 a second, a primary and its two standbys took three quarters of a core).
        self.pace_s = pace_s
        self.writer_id = uuid.uuid4().hex[:8]
        self.max_rows = max_rows
        self.max_seconds = max_seconds
        self.acked: list[int] = []
        self.errors: list[str] = []
        self.acked_at: list[float] = []  # when each acknowledgement came (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"writer-{self.writer_id}", daemon=True)

    def __enter__(self) -> AckedWriter:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 120) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the writer is still blocked in a commit"

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.acked)

    def longest_gap(self, since: float) -> float:
        """The longest time without an acknowledgement from `since` (monotonic) to the latest one:
        the write pause an application saw."""
        with self._lock:
            times = [since, *(t for t in self.acked_at if t > since)]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def acked_between(self, start: float, end: float) -> int:
        """How many commits were acknowledged from `start` to `end` (monotonic)."""
        with self._lock:
            return sum(1 for t in self.acked_at if start <= t <= end)

    def wait_for_acks(self, more: int, timeout_s: float, what: str) -> None:
        """Wait until `more` further commits are acknowledged."""
        target = self.count + more
        deadline = time.monotonic() + timeout_s
        while self.count < target:
            if time.monotonic() > deadline:
                last = self.errors[-1] if self.errors else "no error"
                raise AssertionError(f"{what}: only {self.count - target + more} of {more} commits acknowledged "
                                     f"in {timeout_s:.0f} s (last error: {last})")
            time.sleep(0.2)

    def _run(self) -> None:
        if self.netns is not None:
            join_netns(str(self.netns))  # this thread only
        deadline = time.monotonic() + self.max_seconds
        conn: psycopg.Connection | None = None
        seq = 0
        while not self._stop.is_set() and seq < self.max_rows and time.monotonic() < deadline:
            if conn is None:
                try:
                    dsn = self.dsn()
                    if dsn is None:
                        raise RuntimeError("no DSN for the instance yet")
                    conn = psycopg.connect(dsn, connect_timeout=3, autocommit=True,
                                           application_name=f"fault-writer-{self.writer_id}",
                                           sslmode="verify-ca", sslrootcert=str(self.ca_file))
                    conn.execute(f"create table if not exists {TABLE} (writer text, seq int, "
                                 "at timestamptz default now(), primary key (writer, seq))")
                except Exception as exc:  # the primary may be down: that is the point
                    self.errors.append(f"connect: {exc}")
                    conn = None
                    self._stop.wait(0.3)
                    continue
            seq += 1
            try:
                conn.execute(f"insert into {TABLE} (writer, seq) values (%s, %s)", (self.writer_id, seq))
            except psycopg.Error as exc:
                # Outcome unknown (the commit may or may not have happened): not acknowledged.
                self.errors.append(f"insert {seq}: {exc}")
                conn.close()
                conn = None
                continue
            with self._lock:
                self.acked.append(seq)
                self.acked_at.append(time.monotonic())
            self._stop.wait(self.pace_s)
        if conn is not None:
            conn.close()

    def missing(self, conn: psycopg.Connection) -> list[int]:
        """Acknowledged rows that `conn`'s database does not have (must be [])."""
        rows = conn.execute(f"select seq from {TABLE} where writer = %s", (self.writer_id,)).fetchall()
        present = {r[0] for r in rows}
        with self._lock:
            return [s for s in self.acked if s not in present]


def in_netns(netns: Path, work: Callable[[], T]) -> T:
    """`work()` run on a thread of its own that first joins network namespace `netns`."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            join_netns(str(netns))
            result.append(work())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="in-netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
