"""One acting manager per state directory.

A second `pgcarve serve` on another port, or `pgcarve up`, `purge` or `down` while a server
runs, would act on the same guests with its own locks and its own idea of what is half-made:
each would discard what the other is building and repair what the other removes. So whatever
acts on a fleet from a state directory first takes an exclusive flock(2) on
<state>/manager.lock and holds it for as long as it acts. The kernel drops the lock when the
holder exits, however it ends (SIGKILL, a crash), so a file left behind never blocks anyone.

The holder writes who it is into the file (its process record, what it is doing, its URL once
it listens), so a refused start names the process that holds the fleet and how to stop it.

A fleet with etcd can have several servers (control/leadership.py decides which one acts, with a
fenced lease): there each `pgcarve serve` holds the lock *shared*, so servers on one state
directory run side by side as leader and standbys (exactly as on different machines), while
`pgcarve up`, `purge`, `down` and `advise`, which take it exclusively, are still refused while
any server runs. Shared holders do not write the file (they would overwrite each other); a refusal
then names the servers from their records in <state>/servers/.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from pgcarve.errors import Conflict
from pgcarve.processes import ProcessRecord, ProcessStatus, check, read_record, record_self

LOCK_FILE = "manager.lock"
SERVERS_DIR = "servers"  # Paths.servers_dir


class ManagerLock:
    """The exclusive right to act on the fleet of one state directory, for this process."""

    def __init__(self, state_dir: Path, doing: str, shared: bool = False):
        self.path = state_dir / LOCK_FILE
        self.doing = doing  # e.g. "pgcarve serve", "pgcarve up", shown to whoever is refused
        self.shared = shared  # a server among several (etcd decides which acts)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise Conflict naming the process that holds it. Changes nothing
        when refused."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Conflict(f"another pgcarve manager acts on this fleet from {self.path.parent}: "
                           f"{holder_description(self.path)}; {self.doing} did not start. Use that one, "
                           "or stop it first (`pgcarve server stop` for a server)") from None
        self._fd = fd
        self.note()

    def note(self, **fields: Any) -> None:
        """Rewrite who holds the lock (this process, what it does, `fields` such as its URL). The
        file is rewritten in place: replacing it would leave the lock on a file nobody opens."""
        if self._fd is None:
            raise RuntimeError("the manager lock is not held")
        if self.shared:
            return  # several holders: each server's record is in <state>/servers/
        text = json.dumps({**fields, "doing": self.doing, **record_self().to_dict()})
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            if not self.shared:
                os.ftruncate(self._fd, 0)  # a stale description must not name this process later
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> ManagerLock:
        self.acquire()
        return self

    def __exit__(self, _type: type[BaseException] | None, _value: BaseException | None,
                 _traceback: TracebackType | None) -> None:
        self.release()


def holder_description(path: Path) -> str:
    """Who holds the lock at `path`, in words: what it does, its PID and URL if it wrote them."""
    record, data = read_record(path)
    if record is None:
        servers = running_servers(path.parent / SERVERS_DIR)
        if servers:  # servers among several hold the lock shared and write no description
            return "; ".join(f"pgcarve serve (pid {d['pid']}, {d.get('url', 'no URL yet')})" for _r, d in servers)
        return "a process that has not said who it is yet"
    described = f"{data.get('doing', 'a pgcarve process')} (pid {record.pid}"
    if data.get("url"):
        described += f", {data['url']}"
    if check(record) is not ProcessStatus.RUNNING:  # only possible if the lock holder is another one now
        described += ", its record is stale"
    return described + ")"


def running_servers(directory: Path) -> list[tuple[ProcessRecord, dict[str, Any]]]:
    """The servers recorded in `directory` (Paths.servers_dir) whose process still runs, oldest first."""
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        record, data = read_record(path)
        if record is not None and check(record) is ProcessStatus.RUNNING:
            found.append((record, data))
    return sorted(found, key=lambda item: item[0].start_time)
