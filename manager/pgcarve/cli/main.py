"""The `pgcarve` command line.

    pgcarve sandbox up [--hosts N] | down | status | kill-guest NAME | restart-libvirtd HOST
    pgcarve up --instances N        create/keep N instances and wait until they accept SQL
    pgcarve status [--json]         instances, their pinned host CPUs, state and DSN
    pgcarve down --confirm FLEET    remove every instance of the fleet
    pgcarve plan --instances N      explain the CPU/NUMA plan (text, json or tfvars)
    pgcarve doctor                  check every host before a scale (exit 1 if a scale would fail)
    pgcarve advise                  measure whether carving this host helps, into how many guests, and why
    pgcarve etcd-certificate NAME   an etcd member's (--ip ...) or client's (--client) certificate
    pgcarve state export FILE       the fleet's secrets, CA and journal, encrypted (--key-file); import restores
    pgcarve load                    the experiment's insert load on every primary (pgbench)
    pgcarve scale N                 ask the running API server to scale
    pgcarve switchover NAME         hand the primary role to a standby (--to STANDBY), nothing lost
    pgcarve failover NAME --to S    promote a standby by hand (--force: even if it may lack commits)
    pgcarve incidents               faults noticed and what was done
    pgcarve connect NAME [--ro]     psql on an instance as its application role (via the API)
    pgcarve dsn NAME [--ro]         the instance's URI, which follows failover
    pgcarve service-file            pg_service.conf + .pgpass, for `psql service=NAME`
    pgcarve server start | stop     the API server in the background
    pgcarve serve                   run the REST API and dashboard
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pgcarve.cli import (
    advise_commands,
    backup_commands,
    connect_commands,
    doctor_commands,
    etcd_commands,
    fleet_commands,
    ha_commands,
    sandbox_commands,
    server_commands,
    state_commands,
)
from pgcarve.cli.display import console
from pgcarve.errors import (
    CapacityError,
    ConfigError,
    Conflict,
    HostUnreachable,
    ImageMissing,
    NotFound,
    PgcarveError,
)
from pgcarve.settings import Settings

EXIT_CODES: dict[type[PgcarveError], int] = {
    ConfigError: 2,
    CapacityError: 3,
    HostUnreachable: 4,
    ImageMissing: 5,
    NotFound: 6,
    Conflict: 7,
}


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgcarve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts-file", help="hosts.yaml to use (default: ./hosts.yaml, else the sandbox's)")
    sub = parser.add_subparsers(dest="command", required=True)

    sandbox_commands.add_parsers(sub)

    up = sub.add_parser("up", help="create instances until there are N, wait until they accept SQL")
    up.add_argument("--instances", type=int, required=True)
    up.set_defaults(func=fleet_commands.cmd_up)

    status = sub.add_parser("status", help="instances, pinned host CPUs, state, DSN")
    status.add_argument("--json", action="store_true")
    status.add_argument("--local", action="store_true", help="read libvirt directly even if a server runs")
    status.set_defaults(func=fleet_commands.cmd_status)

    down = sub.add_parser("down", help="remove every instance of the fleet, retired ones too (their data goes too); "
                                       "refused while a server runs")
    down.add_argument("--confirm", metavar="FLEET", help="the fleet's name (asked for on a terminal otherwise)")
    down.add_argument("--real-hosts", action="store_true",
                      help="needed when the hosts file is not this machine's running sandbox")
    down.set_defaults(func=fleet_commands.cmd_down)

    purge = sub.add_parser("purge", help="delete a retired instance's disks (its database) for good")
    purge.add_argument("name", help="the retired instance, e.g. pgc-02")
    purge.add_argument("--confirm", metavar="NAME", help="the name again (asked for on a terminal otherwise)")
    purge.set_defaults(func=fleet_commands.cmd_purge)

    plan = sub.add_parser("plan", help="explain which host CPUs and NUMA node each instance gets")
    plan.add_argument("--instances", type=int, required=True)
    plan.add_argument("--host", help="only this host")
    plan.add_argument("--format", choices=["text", "json", "tfvars"], default="text")
    plan.set_defaults(func=fleet_commands.cmd_plan)

    doctor_commands.add_parser(sub)
    advise_commands.add_parser(sub)
    etcd_commands.add_parser(sub)
    state_commands.add_parsers(sub)

    load = sub.add_parser("load", help="run the experiment's insert-only pgbench on every primary")
    load.add_argument("--seconds", type=int, default=20)
    load.add_argument("--clients", type=int, default=8)
    load.add_argument("--jobs", type=int, default=2)
    load.add_argument("--json", help="also write the results to this file")
    load.set_defaults(func=fleet_commands.cmd_load)

    scale = sub.add_parser("scale", help="ask the running API server to scale to N instances")
    scale.add_argument("instances", type=int)
    scale.add_argument("--url", help="API base URL (default: the local server)")
    scale.add_argument("--no-wait", action="store_true")
    scale.set_defaults(func=server_commands.cmd_scale)

    ha_commands.add_parsers(sub)
    backup_commands.add_parsers(sub)
    connect_commands.add_parsers(sub)

    server = sub.add_parser("server", help="start/stop `pgcarve serve` in the background")
    server.add_argument("action", choices=["start", "stop"])
    server.add_argument("--bind", default=settings.bind)
    server.add_argument("--port", type=int, default=settings.port)
    server.set_defaults(func=server_commands.cmd_server)

    serve = sub.add_parser("serve", help="run the REST API and dashboard")
    serve.add_argument("--bind", default=settings.bind)
    serve.add_argument("--port", type=int, default=settings.port)
    serve.set_defaults(func=server_commands.cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    settings = Settings()
    args = build_parser(settings).parse_args(argv)
    func: Callable[[argparse.Namespace, Settings], int] = args.func
    try:
        return func(args, settings)
    except PgcarveError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        # A subclass (PatroniRefused is a Conflict) exits as its family does.
        return next((code for kind, code in EXIT_CODES.items() if isinstance(exc, kind)), 1)
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
