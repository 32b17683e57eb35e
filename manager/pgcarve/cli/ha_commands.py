"""Role changes and faults from the command line, through the running API server: what the API
and dashboard already offer (switchover, failover by hand, the incident list).

    pgcarve switchover NAME [--to STANDBY]          a planned role swap, nothing lost
    pgcarve failover NAME --to STANDBY [--force]    promote by hand (forced: may lose commits)
    pgcarve incidents [--instance NAME] [--json]    faults noticed and what was done
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any
from urllib.parse import quote

from rich.table import Table

from pgcarve.cli.client import ApiClient
from pgcarve.cli.display import console, out, send_and_follow
from pgcarve.errors import ConfigError
from pgcarve.settings import Settings


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    switchover = sub.add_parser("switchover", help="hand an instance's primary role to a standby, nothing lost")
    switchover.add_argument("name", help="the instance, e.g. pgc-01")
    switchover.add_argument("--to", metavar="STANDBY", help="the standby guest (default: the synchronous one)")
    switchover.add_argument("--url", help="API base URL (default: the local server)")
    switchover.add_argument("--no-wait", action="store_true")
    switchover.set_defaults(func=cmd_switchover)

    failover = sub.add_parser("failover", help="promote a standby by hand (with --force even if it may lack "
                                               "acknowledged commits)")
    failover.add_argument("name", help="the instance, e.g. pgc-01")
    failover.add_argument("--to", metavar="STANDBY", required=True, help="the standby guest to promote")
    failover.add_argument("--force", action="store_true",
                          help="promote it even if it cannot be proven to hold every acknowledged commit")
    failover.add_argument("--confirm", metavar="NAME",
                          help="with --force: the instance's name again (asked for on a terminal otherwise)")
    failover.add_argument("--url", help="API base URL (default: the local server)")
    failover.add_argument("--no-wait", action="store_true")
    failover.set_defaults(func=cmd_failover)

    incidents = sub.add_parser("incidents", help="faults the manager noticed and what it did about them")
    incidents.add_argument("--instance", metavar="NAME", help="only this instance's")
    incidents.add_argument("--json", action="store_true")
    incidents.add_argument("--url", help="API base URL (default: the local server)")
    incidents.set_defaults(func=cmd_incidents)


def cmd_switchover(args: argparse.Namespace, settings: Settings) -> int:
    body = {"to": args.to} if args.to else {}
    return _role_change(args, settings, "switchover", body)


def cmd_failover(args: argparse.Namespace, settings: Settings) -> int:
    if args.force:
        confirm = args.confirm
        if confirm is None and sys.stdin.isatty():
            confirm = console.input(f"A forced failover may lose commits {args.name}'s primary acknowledged. Type "
                                    f"{args.name} to promote {args.to} anyway: ").strip()
        if confirm != args.name:
            raise ConfigError(f"nothing promoted: a forced failover may lose acknowledged commits; repeat the "
                              f"instance's name with --confirm {args.name}")
    return _role_change(args, settings, "failover", {"to": args.to, "force": bool(args.force)})


def _role_change(args: argparse.Namespace, settings: Settings, kind: str, body: dict[str, Any]) -> int:
    client = ApiClient.for_settings(settings, args.url)
    op = send_and_follow(client, lambda: client.post(f"/v1/instances/{quote(args.name, safe='')}/{kind}", body),
                         kind, f"{kind} {args.name}", args.no_wait)
    if isinstance(op, int):
        return op
    if op["status"] == "failed":
        console.print(f"[red]{kind} of {args.name} failed: {op['error']}", highlight=False)
        return 1
    result = op.get("result") or {}
    if not result.get("host"):  # nothing changed (e.g. it was the primary already): the reason
        out.print(op.get("message") or f"{kind} of {args.name} done", highlight=False)
        return 0
    said = f"{kind} of {args.name} done: new primary {result['new_primary']} on {result['host']}"
    if result.get("write_pause_s") is not None:
        said += f"; writes paused {result['write_pause_s']:.1f} s"
    out.print(said, highlight=False)
    if result.get("may_be_missing"):
        console.print(f"[yellow]may be missing on {result['new_primary']}: {result['may_be_missing']}",
                      highlight=False)
    return 0


def cmd_incidents(args: argparse.Namespace, settings: Settings) -> int:
    docs: list[dict[str, Any]] = ApiClient.for_settings(settings, args.url).get("/v1/incidents")
    if args.instance:
        docs = [d for d in docs if d["instance"] == args.instance]
    if args.json:
        print(json.dumps(docs, indent=2))
        return 0
    if not docs:
        out.print("no incidents" + (f" for {args.instance}" if args.instance else ""))
        return 0
    table = Table(title="pgcarve incidents")
    for column in ("detected", "instance", "guest", "host", "what", "status", "action", "message"):
        table.add_column(column)
    for doc in docs:
        detected = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["detected_at"]))
        table.add_row(detected, doc["instance"], doc["guest"], doc["host"], doc["what"], doc["status"],
                      doc["action"], doc["message"])
    out.print(table)
    return 0
