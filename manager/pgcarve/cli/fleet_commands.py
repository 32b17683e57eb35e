"""Commands that act on the fleet directly through libvirt: up, status, down, purge, plan, load."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.table import Table

from pgcarve.cli.client import SAMPLE_WAIT_S, ApiClient, read_server
from pgcarve.cli.display import (
    ProgressBoard,
    console,
    instance_rows,
    out,
    print_api_status,
    print_status,
    progress_display,
)
from pgcarve.config import FleetConfig, load_fleet_config
from pgcarve.control.capacity import check_capacity
from pgcarve.control.fleet import Fleet
from pgcarve.control.manager_lock import ManagerLock
from pgcarve.control.removal import discard_half_made, instance_disk_mib, leftovers, remove_instance
from pgcarve.control.retired import retired_doc, retired_instances
from pgcarve.control.retirement import finish_interrupted, purge
from pgcarve.control.state_check import check_state, prepare_state
from pgcarve.errors import ConfigError, Conflict
from pgcarve.planning.planner import explain, plan_host, plan_to_dict
from pgcarve.settings import Settings


def load_config(settings: Settings, hosts_file: str | None) -> FleetConfig:
    path = settings.hosts_file_path(hosts_file)
    if not path.exists():
        raise ConfigError(
            f"no hosts file ({path}): start the local sandbox with `pgcarve sandbox up`, "
            "or write a hosts.yaml (see hosts.sample.yaml) and pass --hosts-file"
        )
    return load_fleet_config(path)


def open_fleet(args: argparse.Namespace, settings: Settings, checked: bool = True) -> Fleet:
    """The fleet of the hosts file. `checked`: StateMissing, before anything is done, if the fleet is
    in use while the state directory lacks what its guests depend on (control/state_check.py)."""
    fleet = Fleet(load_config(settings, args.hosts_file), settings.paths, boot_timeout_s=settings.boot_timeout)
    if checked:
        try:
            check_state(fleet)
        except BaseException:
            fleet.close()
            raise
    return fleet


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from pgcarve.control.scaler import Scaler

    server = read_server(settings.paths)
    if server is not None:
        raise Conflict(f"a pgcarve server runs at {server['url']} and owns the fleet: "
                       f"use `pgcarve scale {args.instances}` instead")
    fleet = open_fleet(args, settings)  # refused before the lock file, too, is made
    with ManagerLock(settings.paths.state_dir, "pgcarve up"):  # a server started meanwhile waits for us
        for what in prepare_state(fleet):
            out.print(f"made {what}")
        check_capacity(fleet, args.instances)
        for what in finish_interrupted(fleet):  # left by an earlier run that was killed
            out.print(f"{what}, left half-way by an interrupted run")
        for what in discard_half_made(fleet):
            out.print(f"removed {what}, left by an interrupted run")
        with progress_display() as progress:
            Scaler(fleet).scale(args.instances, ProgressBoard(progress))
        print_status(fleet, fleet.observe())
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    if read_server(settings.paths) is not None and not args.local:
        client = ApiClient.for_settings(settings)
        docs = client.get("/v1/instances", include="retired")
        if args.json:
            out.print_json(data=docs)
        else:
            print_api_status(client.url, docs)
        return 0
    fleet = open_fleet(args, settings)
    instances = fleet.observe()
    retired = retired_instances(fleet)
    if args.json:
        out.print_json(data=instance_rows(fleet, instances) + [retired_doc(r) for r in retired])
    else:
        print_status(fleet, instances, retired)
    return 0


def cmd_purge(args: argparse.Namespace, settings: Settings) -> int:
    confirm = args.confirm
    if confirm is None and sys.stdin.isatty():
        confirm = console.input(f"Purging deletes the database of {args.name} for good. Type its name to "
                                "confirm: ").strip()
    if confirm != args.name:
        raise ConfigError(f"not purged: purging deletes {args.name}'s database for good; repeat its name with "
                          f"--confirm {args.name}")
    if read_server(settings.paths) is not None:
        done = ApiClient.for_settings(settings).delete(f"/v1/instances/{args.name}", confirm=confirm)
        out.print(f"purged {done['name']}: {done['purged_mib']} MiB of disks deleted ({', '.join(done['volumes'])})")
        return 0
    with ManagerLock(settings.paths.state_dir, "pgcarve purge"):
        retired = purge(open_fleet(args, settings), args.name)
    out.print(f"purged {retired.name}: {retired.disk_mib} MiB of disks deleted")
    return 0


def _is_local_sandbox(settings: Settings, hosts_file: Path) -> bool:
    """The hosts file is the one `pgcarve sandbox up` wrote on this machine, for a sandbox that runs."""
    from pgcarve.sandbox.hosts import Sandbox

    paths = settings.paths
    return hosts_file.resolve() == paths.sandbox_hosts_file.resolve() and Sandbox(paths.sandbox_dir).is_up()


def _bytes(mib: int) -> str:
    size = mib * 1024 * 1024
    return f"{size:,} bytes ({mib / 1024:.1f} GiB)" if mib >= 1024 else f"{size:,} bytes ({mib} MiB)"


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    """Delete every instance of the fleet and its disks, retired ones too: only on the named fleet,
    never while a manager serves it, and on hosts other than the local sandbox only with
    --real-hosts. What goes is listed, in bytes, before anything is deleted."""
    server = read_server(settings.paths)
    if server is not None:
        raise Conflict(f"nothing removed: a pgcarve server (pid {server['pid']}, {server['url']}) serves this "
                       "fleet and would repair what down deletes; stop it first (`pgcarve server stop`)")
    try:
        with ManagerLock(settings.paths.state_dir, "pgcarve down"):
            return _down(args, settings)
    except Conflict as exc:
        raise Conflict(f"nothing removed: {exc}") from None


def _down(args: argparse.Namespace, settings: Settings) -> int:
    # Unchecked: down deletes the fleet, needs none of its secrets and makes none.
    fleet = open_fleet(args, settings, checked=False)  # connects to nothing until asked
    config = fleet.config
    hosts_file = settings.hosts_file_path(args.hosts_file)
    if not args.real_hosts and not _is_local_sandbox(settings, hosts_file):
        raise ConfigError(f"nothing removed: {hosts_file} is not this machine's running sandbox (hosts "
                          f"{', '.join(h.name for h in config.hosts)}); deleting every database on those hosts also "
                          "needs --real-hosts")
    instances = sorted(fleet.observe(with_endpoints=False), key=lambda i: -i.index)
    retired = retired_instances(fleet)
    doomed = [(inst.name, "running", instance_disk_mib(fleet, inst)) for inst in instances]
    doomed += [(r.name, "retired", r.disk_mib) for r in retired]
    if doomed:
        out.print(f"pgcarve down deletes these databases of fleet {config.fleet!r} for good, with their disks:")
        for name, state, mib in doomed:
            out.print(f"  {name:<12} {state:<8} {_bytes(mib)}")
        out.print(f"  in all: {_bytes(sum(mib for _n, _s, mib in doomed))}")
        confirm = args.confirm
        if confirm is None and sys.stdin.isatty():
            confirm = console.input(f"Type the fleet's name ({config.fleet}) to delete them: ").strip()
        if confirm != config.fleet:
            raise ConfigError(f"nothing removed: down deletes {len(doomed)} database(s) for good; repeat the "
                              f"fleet's name with --confirm {config.fleet}")
    for inst in instances:
        console.print(f"removing {inst.name} and its standbys")
        remove_instance(fleet, inst)
    for gone in retired:
        console.print(f"deleting the kept disks of retired {gone.name}")
        purge(fleet, gone.name)
    left = leftovers(fleet)
    if left:
        console.print(f"[red]left behind: {', '.join(left)}")
        return 1
    out.print(f"removed {len(instances)} instance(s) and {len(retired)} retired one(s)")
    return 0


def cmd_plan(args: argparse.Namespace, settings: Settings) -> int:
    fleet = open_fleet(args, settings)
    hosts = [fleet.config.host(args.host)] if args.host else fleet.config.hosts
    if args.format == "tfvars":
        from pgcarve.tfvars import render_tfvars

        # The seeds carry the admin password and the CA: never new ones over live guests.
        for what in prepare_state(fleet):
            console.print(f"made {what}")
        if args.host is None and len(fleet.config.primary_hosts) != 1:
            raise ConfigError("--format tfvars describes one host: name it with --host")
        host = hosts[0] if args.host else fleet.config.primary_hosts[0]
        # Plain stdout, not rich: the JSON has to reach the .tfvars.json file unchanged.
        sys.stdout.write(render_tfvars(fleet, host.name, args.instances))
        return 0
    planner = fleet.placement.planner
    documents = []
    for host in hosts:
        topology = fleet.topology(host.name)
        plan = plan_host(topology, planner, args.instances)
        if args.format == "json":
            documents.append({"host": host.name, "role": host.role, **plan_to_dict(plan)})
        else:
            out.print(f"[bold]{host.name}[/bold] ({host.role}, {host.uri})")
            out.print(explain(plan, topology, planner), highlight=False)
    if args.format == "json":
        out.print_json(data=documents)
    return 0


def cmd_load(args: argparse.Namespace, settings: Settings) -> int:
    from pgcarve.postgres.pgbench import run_concurrently, setup_transactions

    fleet = open_fleet(args, settings)
    console.print(f"pgbench: insert-only, {args.clients} clients x {args.jobs} threads, {args.seconds} s "
                  "on every primary at once")
    # instance name -> (its primary guest, how to reach it)
    loaded = {inst.name: (inst.primary.name, inst.primary.endpoint) for inst in fleet.observe()
              if inst.primary and inst.primary.endpoint}
    primaries = list(loaded.values())
    client = ApiClient.for_settings(settings) if read_server(settings.paths) is not None else None
    if client is not None:
        # Count from a moment the API has sampled every primary afresh: the first commits of a
        # primary it had not polled yet would be missing from its figure (not from pgbench's), and
        # writes made before a stale sample would be in it.
        unsampled = client.wait_until_sampled(list(loaded), since=time.time())
        if unsampled:
            out.print(f"the API's collector has had no answer from {', '.join(unsampled)} for {SAMPLE_WAIT_S:.0f} s: "
                      "the load runs anyway, and the API's count cannot be compared with pgbench's")
    window_start = time.time()  # before run_pgbench's CREATE TABLE, which the set-up count includes
    results = run_concurrently(primaries, fleet.credentials.admin_password, args.clients, args.jobs, args.seconds,
                               tls=fleet.client_tls)
    table = Table(title="pgbench insert into test(info) values (null)")
    for column in ("instance", "TPS", "latency avg (ms)", "transactions", "failed"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r.instance, f"{r.tps:,.1f}", f"{r.latency_avg_ms or 0:.2f}", str(r.transactions), str(r.failed))
    table.add_row("[bold]total", f"[bold]{sum(r.tps for r in results):,.1f}", "",
                  str(sum(r.transactions for r in results)), str(sum(r.failed for r in results)))
    out.print(table)
    if client is not None:
        counted = client.transactions_during(window_start, max(r.finished_at for r in results),
                                             instances=tuple(loaded))
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
                      f"(from {client.url}/v1/tps/history)")
        else:
            out.print(f"the API at {client.url} has no count covering the whole run, so it is not compared with "
                      "pgbench: its collector had not sampled every primary before the run, or a primary did not "
                      f"answer its collector within {SAMPLE_WAIT_S:.0f} s after it (see the server log)")
        out.print(f"dashboard: {client.url}/")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.__dict__.items() if k != "output"}
                                               for r in results], indent=2))
    return 0
