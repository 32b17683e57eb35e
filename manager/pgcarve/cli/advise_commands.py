"""`pgcarve advise`: does carving help on this host, into how many guests, and why.

Exit status: 0 when the run finished and left the host as it was (whatever the verdict), 1 when
a case failed or something was left behind, and the usual error codes (cli/main.py EXIT_CODES)
for a request refused before anything was created.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from pgcarve.advice.advisor import run_advice
from pgcarve.advice.plan import MIN_SECONDS, AdviceRequest, plan_advice
from pgcarve.advice.report import render_html, render_text
from pgcarve.cli.display import console, out
from pgcarve.cli.fleet_commands import open_fleet
from pgcarve.control.manager_lock import ManagerLock
from pgcarve.control.state_check import prepare_state
from pgcarve.errors import ConfigError
from pgcarve.settings import Settings


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    advise = sub.add_parser("advise", help="measure whether carving a host into guests helps, into how many, and why")
    advise.add_argument("--host", help="the primary host to carve (default: the hosts file's first primary host)")
    advise.add_argument("--max-instances", type=int, metavar="N", help="carve at most N guests (default: capacity)")
    advise.add_argument("--seconds", type=int, default=30, help=f"pgbench run length (at least {MIN_SECONDS})")
    advise.add_argument("--repeat", type=int, default=3, help="runs of every case, interleaved (default 3; fewer "
                                                              "always gives an inconclusive verdict)")
    advise.add_argument("--clients", type=int, help="pgbench clients per case (default: found by a short ramp)")
    advise.add_argument("--format", choices=["text", "json"], default="text")
    advise.add_argument("--report", metavar="FILE.html", help="also write the report as an HTML page")
    advise.add_argument("--spare", action="store_true", help="use only the free slots of a host that runs guests")
    advise.add_argument("--plan-only", action="store_true", help="print what would be carved and how long it would "
                                                                 "take; change nothing")
    advise.add_argument("--image", metavar="DIR", help="the guest image directory to measure (default: the "
                                                       "configured image)")
    advise.set_defaults(func=cmd_advise)


def request_of(args: argparse.Namespace) -> AdviceRequest:
    image = Path(args.image) if args.image else None
    if image is not None and not (image / "image.tag").exists():
        raise ConfigError(f"--image {image}: not a guest image directory (no image.tag; build one with make image)")
    request = AdviceRequest(host=args.host, max_instances=args.max_instances, seconds=args.seconds,
                            repeat=args.repeat, clients=args.clients, spare=args.spare, image_dir=image)
    request.check()
    return request


def cmd_advise(args: argparse.Namespace, settings: Settings) -> int:
    request = request_of(args)  # options wrong whatever the hosts: refused before any connection
    if args.report and not Path(args.report).parent.is_dir():
        raise ConfigError(f"--report {args.report}: no directory {Path(args.report).parent}")
    fleet = open_fleet(args, settings)
    try:
        plan = plan_advice(fleet, request)
        if args.plan_only:
            if args.format == "json":
                out.print_json(data=plan.to_dict())
            else:
                out.print("pgcarve advise --plan-only: nothing is created", highlight=False)
                for line in plan.describe():
                    out.print(line, highlight=False, soft_wrap=True)
            return 0
        for line in plan.describe():
            console.print(line, highlight=False, soft_wrap=True)
        # The run creates and removes guests on the fleet's hosts: not beside a manager acting on them
        # (a running server runs advice itself: POST /v1/advice).
        with ManagerLock(settings.paths.state_dir, "pgcarve advise"), \
                Progress(TextColumn("[bold]advise"), BarColumn(bar_width=30), TaskProgressColumn(),
                         TextColumn("{task.fields[step]}"), TimeElapsedColumn(), console=console) as bar:
            for what in prepare_state(fleet):  # its guests are seeded with the fleet's admin password and CA
                bar.console.print(f"made {what}")
            task = bar.add_task("advise", total=1.0, step="starting")
            lock = threading.Lock()

            def step(done: int, total: int, what: str) -> None:
                with lock:
                    bar.update(task, completed=done / total if total else 0.0, step=what)

            doc = run_advice(fleet, plan, say=lambda m: bar.console.print(m, highlight=False), step=step)
    finally:
        fleet.close()
    if args.report:
        Path(args.report).write_text(render_html(doc))
    if args.format == "json":
        out.print_json(json.dumps(doc))
    else:
        out.print(render_text(doc), highlight=False, soft_wrap=True)
        if args.report:
            out.print(f"report: {args.report}", highlight=False)
    failed = any("error" in c for c in doc.get("cases", {}).values())
    return 0 if doc.get("host_left_as_it_was") and not failed else 1
