"""Operations: accepted requests, run one at a time, with progress an operator can follow.

Every accepted `PUT /v1/scale` (and failover or switchover by hand) becomes an Operation. A single
worker runs them in order; when several scales are waiting, only the newest runs and the older
ones fail as "superseded", so the fleet ends at the last accepted request without walking through
every intermediate size. Operations
are journaled to the state directory, so a manager that is killed mid-operation finds the
unfinished one on restart and runs it again to completion (scaling is idempotent).

Among several managers (control/leadership.py) the queue has a `guard`: the worker runs
operations only while this manager leads, each bound to the epoch it began under, and the journal
is written only by the leader: a standby, or an old leader that lost its lease, never overwrites
it. A manager that takes over calls `resume()`, which reads the journal again and re-queues what
was left unfinished.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol

Status = Literal["pending", "running", "succeeded", "failed"]


@dataclass
class Operation:
    id: str
    kind: str
    target: int
    status: Status = "pending"
    progress: float = 0.0
    message: str = "waiting to start"
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    steps: dict[str, dict[str, object]] = field(default_factory=dict)  # per guest: step, fraction
    seq: int = 0  # acceptance order
    params: dict[str, object] = field(default_factory=dict)  # failover/switchover: instance, to, force
    result: dict[str, object] = field(default_factory=dict)  # what it did, for the API

    def public(self) -> dict[str, object]:
        return asdict(self)


class Guard(Protocol):
    """Whether this manager may act (control/leadership.Leadership)."""

    def holds(self) -> bool: ...

    def acting(self) -> AbstractContextManager[int]: ...


# How often an idle worker looks again whether it may act (leadership changes without a notify).
GUARD_POLL_S = 0.5


class OperationQueue:
    """Accepts operations and runs them one at a time on a worker thread."""

    def __init__(self, run: Callable[[Operation], str | None], journal: Path | None = None, keep: int = 200,
                 guard: Guard | None = None):
        self._run = run
        self.guard = guard
        # Operation kinds run by layers above control (the API's advice): kind -> runner. Register
        # before start(), so that one resumed from the journal finds its runner.
        self.runners: dict[str, Callable[[Operation], str | None]] = {}
        self._journal = journal
        self._keep = keep
        self._ops: dict[str, Operation] = {}
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._seq = 0
        self._thread = threading.Thread(target=self._worker, name="pgcarve-operations", daemon=True)
        self.counts: dict[str, int] = {"accepted": 0, "succeeded": 0, "failed": 0, "superseded": 0}

    def start(self, resume: bool = True) -> list[Operation]:
        """Start the worker; returns operations found unfinished in the journal (re-queued).
        `resume=False`: a standby, which reads the journal only when it takes over (`resume`)."""
        resumed = self._load_journal() if resume else []
        self._thread.start()
        return resumed

    def resume(self) -> list[Operation]:
        """Read the journal again, as a manager that just took over: what the previous leader
        left unfinished is queued again; what this process remembered from an earlier term is
        replaced by what the journal says now."""
        with self._cond:
            self._ops.clear()
            self._pending.clear()
        resumed = self._load_journal()
        with self._cond:
            self._seq = max([self._seq, *(o.seq for o in self._ops.values())])
            self._cond.notify_all()
        return resumed

    def _may_act(self) -> bool:
        return self.guard is None or self.guard.holds()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def submit(self, kind: str, target: int, params: dict[str, object] | None = None) -> Operation:
        with self._cond:
            # Created under the lock, so creation order is the order the worker sees.
            self._seq += 1
            op = Operation(id=uuid.uuid4().hex[:12], kind=kind, target=target, seq=self._seq,
                           params=dict(params or {}))
            self._ops[op.id] = op
            self._pending.append(op.id)
            self.counts["accepted"] += 1
            self._save()
            self._cond.notify_all()
        return op

    def get(self, op_id: str) -> Operation | None:
        with self._cond:
            return self._ops.get(op_id)

    def all(self) -> list[Operation]:
        with self._cond:
            return sorted(self._ops.values(), key=lambda o: (o.created_at, o.seq))

    def active(self) -> list[Operation]:
        return [op for op in self.all() if op.status in ("pending", "running")]

    def update(self, op: Operation, **changes: object) -> None:
        with self._cond:
            for key, value in changes.items():
                setattr(op, key, value)
            self._save()

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or any(o.status == "running" for o in self._ops.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def _worker(self) -> None:
        while True:
            with self._cond:
                while (not self._pending or not self._may_act()) and not self._stopped:
                    self._cond.wait(GUARD_POLL_S if self.guard is not None else None)
                if self._stopped:
                    return
                # Of the scale requests waiting, only the newest runs; others run in order.
                scales = [i for i in self._pending if self._ops[i].kind == "scale"]
                for op_id in scales[:-1]:
                    old = self._ops[op_id]
                    old.status, old.finished_at = "failed", time.time()
                    old.error = f"superseded by a later scale request (operation {scales[-1]}) before it started"
                    self.counts["superseded"] += 1
                    self._pending.remove(op_id)
                op = self._ops[self._pending.pop(0)]
                op.status, op.started_at, op.message = "running", time.time(), "starting"
                self._save()
            try:
                # Bound to the epoch it starts under: a step after a takeover elsewhere is refused.
                with self.guard.acting() if self.guard is not None else contextlib.nullcontext(0):
                    summary = self.runners.get(op.kind, self._run)(op)  # what was done, in words (None: nothing to add)
                final: dict[str, object] = {"status": "succeeded", "progress": 1.0, "message": summary or "done"}
                self.counts["succeeded"] += 1
            except Exception as exc:
                final = {"status": "failed", "error": str(exc) or type(exc).__name__, "message": "failed"}
                self.counts["failed"] += 1
            with self._cond:
                for key, value in final.items():
                    setattr(op, key, value)
                op.finished_at = time.time()
                self._save()
                self._cond.notify_all()

    # -- journal -------------------------------------------------------------------------------

    def _save(self) -> None:
        if self._journal is None or not self._may_act():  # only the leader writes the journal
            return
        ops = sorted(self._ops.values(), key=lambda o: o.created_at)[-self._keep:]
        tmp = self._journal.with_name(f"{self._journal.name}.{os.getpid()}.tmp")  # managers may share the directory
        tmp.write_text(json.dumps([o.public() for o in ops], indent=1))
        tmp.replace(self._journal)

    def _load_journal(self) -> list[Operation]:
        if self._journal is None or not self._journal.exists():
            return []
        try:
            records = json.loads(self._journal.read_text())
        except json.JSONDecodeError:
            return []
        resumed = []
        with self._cond:
            for record in records:
                op = Operation(**record)
                self._ops[op.id] = op
                if op.status in ("pending", "running"):
                    op.status, op.message = "pending", "resumed after a manager restart"
                    self._pending.append(op.id)
                    resumed.append(op)
        return resumed
