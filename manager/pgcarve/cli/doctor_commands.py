"""`pgcarve doctor`: every host checked before a scale, with what to do about each problem.

Exit status: 0 when nothing found would make a scale fail, 1 when something would (a "fail"
finding), 2 when the hosts file itself is invalid (ConfigError, as for every command).
"""

from __future__ import annotations

import argparse

from rich.table import Table
from rich.text import Text

from pgcarve.cli.display import out
from pgcarve.cli.fleet_commands import open_fleet
from pgcarve.control.doctor import Doctor
from pgcarve.control.doctor_report import Finding, summary
from pgcarve.settings import Settings

STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser("doctor", help="check every host before a scale: what is missing or wrong, per host")
    doctor.add_argument("--instances", type=int,
                        help="check for a scale to N instances (default: as many as the fleet has room for)")
    doctor.add_argument("--upload-image", action="store_true",
                        help="upload the guest image where it is missing, as `pgcarve up` would, so the KVM probe "
                             "can boot it (otherwise nothing on a host is changed)")
    doctor.add_argument("--format", choices=["text", "json"], default="text")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace, settings: Settings) -> int:
    fleet = open_fleet(args, settings)
    try:
        findings = Doctor(fleet, args.instances, upload_image=args.upload_image).run()
    finally:
        fleet.close()
    line = summary(findings, len(fleet.config.hosts))
    failed = any(f.status == "fail" for f in findings)
    if args.format == "json":
        out.print_json(data={"findings": [f.to_dict() for f in findings], "fail": failed, "summary": line})
    else:
        print_findings(findings)
        out.print(line, soft_wrap=True, highlight=False)
    return 1 if failed else 0


def print_findings(findings: list[Finding]) -> None:
    table = Table(title="pgcarve doctor")
    for column in ("host", "check", "status", "finding"):
        table.add_column(column, overflow="fold")
    for f in findings:
        # Text, not markup: a message quotes libvirt's words, which may hold brackets.
        table.add_row(Text(f.host), f.check, Text(f.status, style=STYLES[f.status]), Text(f.message))
    out.print(table, highlight=False)
