"""What the command line prints: consoles, progress bars per guest, the status table."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pgcarve.cli.client import ApiClient, ApiError
from pgcarve.control.fleet import Fleet, Instance
from pgcarve.control.retired import RetiredInstance, retired_doc

console = Console(stderr=True)
# Tables hold DSNs: never truncate them, even when stdout is not a terminal.
out = Console(width=max(Console().width, 140))


class ProgressBoard:
    """One progress bar per guest, fed from worker threads (a control.fleet.Progress)."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.tasks: dict[str, Any] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, step: str, fraction: float) -> None:
        with self.lock:
            if name not in self.tasks:
                self.tasks[name] = self.progress.add_task(name, total=1.0, step=step)
            self.progress.update(self.tasks[name], completed=fraction, step=step)


def progress_display() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<14}"),
        BarColumn(bar_width=30),
        TextColumn("{task.fields[step]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def follow_operation(client: ApiClient, op_id: str, title: str) -> dict[str, Any]:
    """Show an API operation's progress as one bar until it succeeds or fails; its last document.
    A guest found stuck while it booted (and built again) is said above the bar as it happens."""
    said: set[str] = set()
    with progress_display() as progress:
        task = progress.add_task(title, total=1.0, step="pending")
        while True:
            op: dict[str, Any] = client.get(f"/v1/operations/{op_id}")
            for guest, step in (op.get("steps") or {}).items():
                for note in step.get("stuck") or ():
                    if note not in said:
                        said.add(note)
                        progress.console.print(f"[yellow]{guest}: {note}", highlight=False)
            progress.update(task, completed=op["progress"], step=op.get("message") or op["status"])
            if op["status"] in ("succeeded", "failed"):
                return op
            time.sleep(0.5)


def send_and_follow(client: ApiClient, send: Callable[[], dict[str, Any]], what: str, title: str,
                    no_wait: bool) -> dict[str, Any] | int:
    """Send a request the API answers with an operation, then follow it with a progress bar: the
    operation's last document, or the exit code when there is none to follow (said here): 1 when
    the API refused it, 0 when `no_wait`."""
    try:
        op_id = str(send()["operation"])
    except ApiError as exc:
        console.print(f"[red]{what} refused ({exc.status}): {exc.detail}", highlight=False)
        return 1
    if no_wait:
        out.print(f"operation {op_id} accepted (follow it: GET /v1/operations/{op_id})")
        return 0
    return follow_operation(client, op_id, title)


def instance_rows(fleet: Fleet, instances: list[Instance]) -> list[dict[str, Any]]:
    rows = []
    for inst in instances:
        for guest in inst.guests:
            rows.append({
                "name": guest.name,
                "instance": inst.name,
                "role": guest.info.metadata.role,
                "host": guest.info.host,
                "host_cpus": list(guest.host_cpus),
                "emulator_cpus": list(guest.info.emulator_cpus),
                "memory_mib": guest.info.memory_mib,
                "state": guest.info.state,
                "address": guest.address,
                "dsn": fleet.dsn(guest.endpoint) if guest.endpoint else None,
            })
    return rows


def print_status(fleet: Fleet, instances: list[Instance], retired: Sequence[RetiredInstance] = ()) -> None:
    table = Table(title=f"pgcarve fleet {fleet.config.fleet!r}")
    for column in ("name", "role", "host", "pinned host CPUs", "state", "DSN"):
        table.add_column(column)
    for row in instance_rows(fleet, instances):
        table.add_row(row["name"], row["role"], row["host"], ",".join(map(str, row["host_cpus"])),
                      row["state"], row["dsn"] or "-")
    for inst in retired:
        for guest in inst.guests:
            table.add_row(guest.name, guest.role, guest.host, "-", f"retired ({guest.disk_mib} MiB kept)", "-")
    out.print(table)
    print_retired_note([retired_doc(r) for r in retired])
    if instances:
        out.print(f"admin DSNs above (user pgcarve, password in {fleet.paths.secrets_file}); applications: "
                  "`pgcarve connect NAME`, `pgcarve dsn NAME` or `pgcarve service-file` (the API server must run)")


def print_api_status(url: str, docs: list[dict[str, Any]]) -> None:
    table = Table(title=f"pgcarve via {url}")
    for column in ("name", "host", "vCPUs (host CPUs)", "state", "DSN", "standbys"):
        table.add_column(column)
    for inst in docs:
        standbys = "; ".join(f"{s['name']}@{s['host']} {s['state']}"
                             + (f"/{s['sync_state']}" if s["sync_state"] else "") for s in inst["standbys"])
        table.add_row(inst["name"], inst["host"], ",".join(map(str, inst["vcpus"])), inst["state"],
                      inst["dsn"] or "-", standbys or "-")
    out.print(table)
    print_retired_note([d for d in docs if d["state"] == "retired"])


def print_retired_note(retired: list[dict[str, Any]]) -> None:
    """Under the status table: what retired instances keep, and how to bring back or delete them."""
    for doc in retired:
        out.print(f"{doc['name']}: {doc['writes']}", highlight=False)
