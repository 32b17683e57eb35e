"""Backups from the command line, through the running API server.

    pgcarve backup NAME [--type full|diff|incr]    take a backup (an operation, followed)
    pgcarve backups NAME [--json]                  the instance's backups and recoverable window
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any
from urllib.parse import quote

from rich.table import Table

from pgcarve.cli.client import ApiClient
from pgcarve.cli.display import console, out, send_and_follow
from pgcarve.settings import Settings


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    backup = sub.add_parser("backup", help="take a backup of an instance (its WAL is archived all along)")
    backup.add_argument("name", help="the instance, e.g. pgc-01")
    backup.add_argument("--type", choices=("full", "diff", "incr"), default="full",
                        help="full (default); diff: changes since the last full; incr: since the last backup")
    backup.add_argument("--url", help="API base URL (default: the local server)")
    backup.add_argument("--no-wait", action="store_true")
    backup.set_defaults(func=cmd_backup)

    backups = sub.add_parser("backups", help="an instance's backups and the window it can be recovered to")
    backups.add_argument("name", help="the instance, e.g. pgc-01")
    backups.add_argument("--json", action="store_true")
    backups.add_argument("--url", help="API base URL (default: the local server)")
    backups.set_defaults(func=cmd_backups)


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def cmd_backup(args: argparse.Namespace, settings: Settings) -> int:
    client = ApiClient.for_settings(settings, args.url)
    path = f"/v1/instances/{quote(args.name, safe='')}/backups"
    op = send_and_follow(client, lambda: client.post(path, {"type": args.type}), "backup",
                         f"{args.type} backup of {args.name}", args.no_wait)
    if isinstance(op, int):
        return op
    if op["status"] == "failed":
        console.print(f"[red]backup of {args.name} failed: {op['error']}", highlight=False)
        return 1
    out.print(op.get("message") or f"backup of {args.name} done", highlight=False)
    return 0


def cmd_backups(args: argparse.Namespace, settings: Settings) -> int:
    doc: dict[str, Any] = ApiClient.for_settings(settings, args.url).get(
        f"/v1/instances/{quote(args.name, safe='')}/backups")
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    table = Table(title=f"backups of {doc['instance']} ({doc['status']})")
    for column in ("label", "type", "started", "stopped", "size MiB", "added MiB", "WAL from", "WAL to"):
        table.add_column(column)
    for b in doc["backups"]:
        table.add_row(b["label"], b["type"], _when(b["started_at"]), _when(b["stopped_at"]),
                      f"{b['size_bytes'] / 2**20:.1f}", f"{b['repository_bytes'] / 2**20:.1f}", b["wal_start"],
                      b["wal_stop"])
    out.print(table)
    window = doc.get("window")
    if window is None:
        out.print("no backup yet: nothing to recover to")
    else:
        out.print(f"recoverable from {_when(window['earliest'])} to the newest archived WAL "
                  f"({window['wal_last'] or 'none yet'}; proven up to {_when(window['latest_proven'])})",
                  highlight=False)
    return 0
