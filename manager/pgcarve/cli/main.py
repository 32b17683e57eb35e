"""The `pgcarve` command line.

    pgcarve sandbox up [--hosts N] | down | status
    pgcarve up --instances N        create/keep N instances and wait until they accept SQL
    pgcarve status [--json]         instances, their pinned host CPUs, state and DSN
    pgcarve down                    remove every instance of the fleet
    pgcarve plan --instances N      explain the CPU/NUMA plan (text, json or tfvars)
    pgcarve scale N                 ask the running API server to scale
    pgcarve serve                   run the REST API and dashboard
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pgcarve.config import FleetConfig, Paths, default_paths, load_fleet_config
from pgcarve.control.fleet import Fleet, Instance
from pgcarve.errors import (
    CapacityError,
    ConfigError,
    Conflict,
    HostUnreachable,
    ImageMissing,
    NotFound,
    PgcarveError,
)
from pgcarve.planning.planner import explain, plan_host, plan_to_dict
from pgcarve.sandbox.hosts import Sandbox

console = Console(stderr=True)
# Tables hold DSNs: never truncate them, even when stdout is not a terminal.
out = Console(width=max(Console().width, 140))

EXIT_CODES: dict[type[PgcarveError], int] = {
    ConfigError: 2,
    CapacityError: 3,
    HostUnreachable: 4,
    ImageMissing: 5,
    NotFound: 6,
    Conflict: 7,
}


def load_config(paths: Paths, hosts_file: str | None) -> FleetConfig:
    path = paths.hosts_file(hosts_file)
    if not path.exists():
        raise ConfigError(
            f"no hosts file ({path}): start the local sandbox with `pgcarve sandbox up`, "
            "or write a hosts.yaml (see hosts.sample.yaml) and pass --hosts-file"
        )
    return load_fleet_config(path)


class ProgressBoard:
    """One progress bar per guest, fed from worker threads."""

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


def instance_rows(fleet: Fleet, instances: list[Instance]) -> list[dict[str, Any]]:
    rows = []
    for inst in instances:
        for guest in (*((inst.primary,) if inst.primary else ()), *inst.standbys):
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


def print_status(fleet: Fleet, instances: list[Instance]) -> None:
    table = Table(title=f"pgcarve fleet {fleet.config.fleet!r}")
    for column in ("name", "role", "host", "pinned host CPUs", "state", "DSN"):
        table.add_column(column)
    for row in instance_rows(fleet, instances):
        table.add_row(row["name"], row["role"], row["host"], ",".join(map(str, row["host_cpus"])),
                      row["state"], row["dsn"] or "-")
    out.print(table)
    if instances:
        out.print(f"password for user pgcarve: in {fleet.paths.secrets_file} (admin_password)")


# -- commands ----------------------------------------------------------------------------------


def cmd_sandbox(args: argparse.Namespace, paths: Paths) -> int:
    sandbox = Sandbox(paths.sandbox_dir)
    if args.action == "up":
        config = sandbox.up(args.hosts, progress=lambda m: console.print(f"sandbox: {m}"))
        for host in config.hosts:
            out.print(f"{host.name}  {host.role:<8} {host.uri}")
        out.print(f"hosts file: {paths.sandbox_hosts_file}")
    elif args.action == "down":
        if paths.sandbox_hosts_file.exists():
            # Remove guests through libvirt first so their disks go too.
            fleet = Fleet(load_fleet_config(paths.sandbox_hosts_file), paths)
            try:
                for inst in fleet.observe(with_endpoints=False):
                    fleet.remove_instance(inst)
            except PgcarveError as exc:
                console.print(f"sandbox: could not remove instances cleanly ({exc}); stopping anyway")
            fleet.close()
        sandbox.down(progress=lambda m: console.print(f"sandbox: {m}"))
        left = sandbox.leftovers()
        if left:
            console.print(f"[red]sandbox: left behind: {', '.join(left)}")
            return 1
        out.print("sandbox: down, nothing left behind")
    else:
        hosts = sandbox.hosts()
        out.print(f"sandbox {'up' if sandbox.is_up() else 'down'}: {len(hosts)} host(s) in {sandbox.directory}")
    return 0


def cmd_up(args: argparse.Namespace, paths: Paths) -> int:
    from pgcarve.control.scaler import Scaler

    server = read_server(paths)
    if server is not None:
        raise Conflict(f"a pgcarve server runs at {server['url']} and owns the fleet: "
                           f"use `pgcarve scale {args.instances}` instead")
    fleet = Fleet(load_config(paths, args.hosts_file), paths)
    fleet.check_capacity(args.instances)
    for what in fleet.discard_half_made():  # left by an earlier run that was killed
        out.print(f"removed {what}, left by an interrupted run")
    with progress_display() as progress:
        Scaler(fleet).scale(args.instances, ProgressBoard(progress))
    print_status(fleet, fleet.observe())
    return 0


def cmd_status(args: argparse.Namespace, paths: Paths) -> int:
    server = read_server(paths)
    if server is not None and not args.local:
        import httpx

        resp = httpx.get(f"{server['url']}/v1/instances", headers=auth_header(paths), timeout=30)
        resp.raise_for_status()
        if args.json:
            out.print_json(data=resp.json())
            return 0
        table = Table(title=f"pgcarve via {server['url']}")
        for column in ("name", "host", "vCPUs (host CPUs)", "state", "DSN", "standbys"):
            table.add_column(column)
        for inst in resp.json():
            standbys = "; ".join(f"{s['name']}@{s['host']} {s['state']}/{s['sync_state']}" for s in inst["standbys"])
            table.add_row(inst["name"], inst["host"], ",".join(map(str, inst["vcpus"])), inst["state"],
                          inst["dsn"] or "-", standbys or "-")
        out.print(table)
        return 0
    fleet = Fleet(load_config(paths, args.hosts_file), paths)
    instances = fleet.observe()
    if args.json:
        out.print_json(data=instance_rows(fleet, instances))
    else:
        print_status(fleet, instances)
    return 0


def cmd_down(args: argparse.Namespace, paths: Paths) -> int:
    fleet = Fleet(load_config(paths, args.hosts_file), paths)
    instances = fleet.observe(with_endpoints=False)
    for inst in sorted(instances, key=lambda i: -i.index):
        console.print(f"removing {inst.name} and its standbys")
        fleet.remove_instance(inst)
    left = fleet.leftovers()
    if left:
        console.print(f"[red]left behind: {', '.join(left)}")
        return 1
    out.print(f"removed {len(instances)} instance(s)")
    return 0


def cmd_plan(args: argparse.Namespace, paths: Paths) -> int:
    fleet = Fleet(load_config(paths, args.hosts_file), paths)
    hosts = [fleet.config.host(args.host)] if args.host else fleet.config.hosts
    if args.format == "tfvars":
        from pgcarve.tfvars import render_tfvars

        if args.host is None and len(fleet.config.primary_hosts) != 1:
            raise ConfigError("--format tfvars describes one host: name it with --host")
        host = hosts[0] if args.host else fleet.config.primary_hosts[0]
        # Plain stdout, not rich: the JSON has to reach the .tfvars.json file unchanged.
        sys.stdout.write(render_tfvars(fleet, host.name, args.instances))
        return 0
    documents = []
    for host in hosts:
        topology = fleet.topology(host.name)
        plan = plan_host(topology, fleet.planner_config, args.instances)
        if args.format == "json":
            documents.append({"host": host.name, "role": host.role, **plan_to_dict(plan)})
        else:
            out.print(f"[bold]{host.name}[/bold] ({host.role}, {host.uri})")
            out.print(explain(plan, topology, fleet.planner_config), highlight=False)
    if args.format == "json":
        out.print_json(data=documents)
    return 0


def cmd_load(args: argparse.Namespace, paths: Paths) -> int:
    from pgcarve.postgres.pgbench import run_on_primaries, setup_transactions

    fleet = Fleet(load_config(paths, args.hosts_file), paths)
    console.print(f"pgbench: insert-only, {args.clients} clients x {args.jobs} threads, {args.seconds} s "
                  "on every primary at once")
    window_start = time.time()  # before run_pgbench's CREATE TABLE, which the set-up count includes
    results = run_on_primaries(fleet, args.clients, args.jobs, args.seconds)
    table = Table(title="pgbench insert into test(info) values (null)")
    for column in ("instance", "TPS", "latency avg (ms)", "transactions", "failed"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.instance, f"{r.tps:,.1f}", f"{r.latency_avg_ms or 0:.2f}", str(r.transactions), str(r.failed))
    table.add_row("[bold]total", f"[bold]{sum(r.tps for r in results):,.1f}", "",
                  str(sum(r.transactions for r in results)), str(sum(r.failed for r in results)))
    out.print(table)
    server = read_server(paths)
    if server is not None:
        counted = api_transactions_during(server["url"], window_start, max(r.finished_at for r in results))
        pgbench_total = sum(r.transactions for r in results)
        setup = sum(setup_transactions(args.clients) for _ in results)
        if counted is not None:
            # Totals over the same window, counted the same way: the API counts client
            # transactions (autovacuum and pgcarve's own sessions left out), pgbench its own
            # transactions; its connection set-up is client work the API sees and pgbench does not.
            expected = pgbench_total + setup
            diff = (counted - expected) / expected * 100 if expected else 0.0
            out.print(f"API over the run: {counted:,} client transactions; pgbench: {pgbench_total:,} + {setup} "
                      f"set-up (connections, PREPARE, CREATE TABLE) = {expected:,}; difference {diff:+.1f}% "
                      f"(from {server['url']}/v1/tps/history)")
        else:
            out.print(f"the API at {server['url']} recorded no samples after the run; its collector may be stopped")
        out.print(f"dashboard: {server['url']}/")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.__dict__.items() if k != "output"}
                                               for r in results], indent=2))
    return 0


def api_transactions_during(url: str, started: float, finished: float, wait_s: float = 30) -> int | None:
    """Client transactions the API counted from `started` until the load was idle after `finished`.

    The difference of the API's running total (xacts_total) between the last sample before
    `started` and the first sample 3 s past `finished`, so the last commits, published up to
    ~1 s late, are in it. Waits for that sample at most `wait_s`; None if none arrives.
    """
    import httpx

    settled = finished + 3
    deadline = time.monotonic() + wait_s
    while True:
        seconds = max(1, int(time.time() - started) + 5)
        history = httpx.get(f"{url}/v1/tps/history", params={"seconds": seconds}, timeout=10).json()
        before = [p for p in history if p["at"] <= started]
        after = [p for p in history if p["at"] >= settled]
        if before and after:
            return int(after[0]["xacts_total"]) - int(before[-1]["xacts_total"])
        if time.monotonic() >= deadline or (history and not before):
            return None
        time.sleep(0.5)  # the collector records one sample per second


def read_server(paths: Paths) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(paths.server_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    from pgcarve.sandbox.forward import pid_alive

    return data if pid_alive(int(data.get("pid", 0))) else None


def auth_header(paths: Paths) -> dict[str, str]:
    token = os.environ.get("PGCARVE_TOKEN")
    if not token and paths.token_file.exists():
        token = paths.token_file.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def cmd_scale(args: argparse.Namespace, paths: Paths) -> int:
    import time

    import httpx

    server = read_server(paths)
    url = args.url or (server["url"] if server else "http://127.0.0.1:8080")
    resp = httpx.put(f"{url}/v1/scale", json={"instances": args.instances}, headers=auth_header(paths), timeout=30)
    if resp.status_code >= 400:
        detail = resp.json().get("detail", resp.text) if resp.headers.get("content-type", "").startswith(
            "application/json") else resp.text
        console.print(f"[red]scale refused ({resp.status_code}): {detail}")
        return 1
    op_id = resp.json()["operation"]
    if args.no_wait:
        out.print(f"operation {op_id} accepted")
        return 0
    with progress_display() as progress:
        task = progress.add_task(f"scale to {args.instances}", total=1.0, step="pending")
        while True:
            op = httpx.get(f"{url}/v1/operations/{op_id}", headers=auth_header(paths), timeout=30).json()
            progress.update(task, completed=op["progress"], step=op.get("message") or op["status"])
            if op["status"] in ("succeeded", "failed"):
                break
            time.sleep(0.5)
    if op["status"] == "failed":
        console.print(f"[red]scale failed: {op['error']}")
        return 1
    out.print(f"scaled to {args.instances} instance(s)")
    return 0


def cmd_server(args: argparse.Namespace, paths: Paths) -> int:
    """Start `pgcarve serve` in the background (pid in server.json), or stop it by that pid."""
    import subprocess
    import time

    import httpx

    from pgcarve.sandbox.forward import stop_pid

    server = read_server(paths)
    if args.action == "stop":
        if server is None:
            out.print("server: not running")
        else:
            stop_pid(int(server["pid"]), timeout_s=20)
            out.print(f"server: stopped (pid {server['pid']})")
        paths.server_file.unlink(missing_ok=True)
        return 0
    if server is not None:
        out.print(f"server: already running at {server['url']} (pid {server['pid']})")
        return 0
    log_path = paths.state_dir / "server.log"
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pgcarve.cli", "serve", "--bind", args.bind, "--port", str(args.port)]
    if args.hosts_file:
        command[3:3] = ["--hosts-file", args.hosts_file]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    url = f"http://{args.bind}:{args.port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PgcarveError(f"the API server exited at start (code {proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        raise PgcarveError(f"the API server did not answer on {url} within 60 s; see {log_path}")
    out.print(f"server: API and dashboard on {url}/ (pid {proc.pid}, log {log_path})")
    out.print(f"server: API token in {paths.token_file} (send it as 'Authorization: Bearer <token>')")
    return 0


def cmd_serve(args: argparse.Namespace, paths: Paths) -> int:
    from pgcarve_api.server import serve

    return serve(host=args.bind, port=args.port, hosts_file=args.hosts_file, paths=paths)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgcarve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts-file", help="hosts.yaml to use (default: ./hosts.yaml, else the sandbox's)")
    sub = parser.add_subparsers(dest="command", required=True)

    sandbox = sub.add_parser("sandbox", help="start/stop the private local libvirt hosts")
    sandbox.add_argument("action", choices=["up", "down", "status"])
    sandbox.add_argument("--hosts", type=int, default=1, help="number of sandbox hosts (1-8)")
    sandbox.set_defaults(func=cmd_sandbox)

    up = sub.add_parser("up", help="create instances until there are N, wait until they accept SQL")
    up.add_argument("--instances", type=int, required=True)
    up.set_defaults(func=cmd_up)

    status = sub.add_parser("status", help="instances, pinned host CPUs, state, DSN")
    status.add_argument("--json", action="store_true")
    status.add_argument("--local", action="store_true", help="read libvirt directly even if a server runs")
    status.set_defaults(func=cmd_status)

    down = sub.add_parser("down", help="remove every instance of the fleet (their data goes too)")
    down.set_defaults(func=cmd_down)

    plan = sub.add_parser("plan", help="explain which host CPUs and NUMA node each instance gets")
    plan.add_argument("--instances", type=int, required=True)
    plan.add_argument("--host", help="only this host")
    plan.add_argument("--format", choices=["text", "json", "tfvars"], default="text")
    plan.set_defaults(func=cmd_plan)

    load = sub.add_parser("load", help="run the experiment's insert-only pgbench on every primary")
    load.add_argument("--seconds", type=int, default=20)
    load.add_argument("--clients", type=int, default=8)
    load.add_argument("--jobs", type=int, default=2)
    load.add_argument("--json", help="also write the results to this file")
    load.set_defaults(func=cmd_load)

    scale = sub.add_parser("scale", help="ask the running API server to scale to N instances")
    scale.add_argument("instances", type=int)
    scale.add_argument("--url", help="API base URL (default: the local server)")
    scale.add_argument("--no-wait", action="store_true")
    scale.set_defaults(func=cmd_scale)

    server = sub.add_parser("server", help="start/stop `pgcarve serve` in the background")
    server.add_argument("action", choices=["start", "stop"])
    server.add_argument("--bind", default=os.environ.get("PGCARVE_BIND", "127.0.0.1"))
    server.add_argument("--port", type=int, default=int(os.environ.get("PGCARVE_PORT", "8080")))
    server.set_defaults(func=cmd_server)

    serve = sub.add_parser("serve", help="run the REST API and dashboard")
    serve.add_argument("--bind", default=os.environ.get("PGCARVE_BIND", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("PGCARVE_PORT", "8080")))
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = default_paths()
    func: Callable[[argparse.Namespace, Paths], int] = args.func
    try:
        return func(args, paths)
    except PgcarveError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return EXIT_CODES.get(type(exc), 1)
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Path", "main"]
