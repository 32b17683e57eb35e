"""`pgcarve sandbox ...`: the private local hosts, and faults injected into them on purpose."""

from __future__ import annotations

import argparse
import os

from pgcarve.cli.display import console, out
from pgcarve.config import load_fleet_config
from pgcarve.control.fleet import Fleet
from pgcarve.control.removal import remove_instance
from pgcarve.errors import NotFound, PgcarveError
from pgcarve.sandbox.faults import SandboxFaults
from pgcarve.sandbox.hosts import Sandbox
from pgcarve.sandbox.remote import TRANSPORTS
from pgcarve.settings import Settings


def cmd_sandbox(args: argparse.Namespace, settings: Settings) -> int:
    paths = settings.paths
    sandbox = Sandbox(paths.sandbox_dir)
    if args.action == "up":
        config = sandbox.up(args.hosts, progress=lambda m: console.print(f"sandbox: {m}"), transport=args.transport)
        for host in config.hosts:
            out.print(f"{host.name}  {host.role:<8} {host.uri}")
        if config.etcd is not None:
            members = sandbox.etcd.members()
            out.print(f"etcd: {len(members)} members ({', '.join(m.name for m in members)}) on "
                      f"{', '.join(m.client_url for m in members)}; the manager's endpoints: "
                      f"{', '.join(config.etcd.endpoints)}")
        out.print(f"hosts file: {paths.sandbox_hosts_file}")
        if args.transport == "ssh":
            out.print(f"manager: run pgcarve in its namespace ({sandbox.manager.netns}, {sandbox.manager.address}) "
                      "with `pgcarve sandbox exec -- pgcarve ...`; offer its API here with `pgcarve sandbox publish`")
    elif args.action == "down":
        if paths.sandbox_hosts_file.exists():
            # Remove guests through libvirt first so their disks go too (through the sandbox's own
            # sockets: with --transport ssh, this machine does not route to the hosts).
            fleet = Fleet(sandbox.backdoor(load_fleet_config(paths.sandbox_hosts_file)), paths)
            try:
                for inst in fleet.observe(with_endpoints=False):
                    remove_instance(fleet, inst)
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
        out.print(f"sandbox {'up' if sandbox.is_up() else 'down'}: {len(hosts)} host(s) in {sandbox.directory}"
                  f"{', transport ' + sandbox.transport if hosts else ''}")
    return 0


def cmd_exec(args: argparse.Namespace, settings: Settings) -> int:
    """Run a command where the sandbox's manager runs (its namespace with --transport ssh)."""
    sandbox = Sandbox(settings.paths.sandbox_dir)
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not command:
        raise PgcarveError("nothing to run: give a command after --, e.g. `pgcarve sandbox exec -- pgcarve status`")
    if sandbox.transport == "ssh" and not sandbox.is_up():
        raise PgcarveError("the sandbox is down: start it with `pgcarve sandbox up --transport ssh`")
    full = sandbox.manager_command(command)
    try:
        os.execvp(full[0], full)  # noqa: S606  (the operator's own command)
    except FileNotFoundError:
        raise PgcarveError(f"cannot run {full[0]!r}: not found") from None
    return 0  # not reached


def cmd_publish(args: argparse.Namespace, settings: Settings) -> int:
    """Offer the manager namespace's API on this machine's 127.0.0.1 (one forward)."""
    sandbox = Sandbox(settings.paths.sandbox_dir)
    if sandbox.transport != "ssh":
        out.print("sandbox: nothing to publish: the manager runs on this machine (transport unix)")
        return 0
    if not sandbox.is_up():
        raise PgcarveError("the sandbox is down: start it with `pgcarve sandbox up --transport ssh`")
    target = f"127.0.0.1:{args.target_port or args.port}"
    sandbox.forwards.publish("api", str(sandbox.manager.netns_path), target, args.port)
    out.print(f"sandbox: 127.0.0.1:{args.port} here reaches {target} in {sandbox.manager.netns}")
    return 0


def cmd_kill_guest(args: argparse.Namespace, settings: Settings) -> int:
    """kill -9 a guest's QEMU, as a crash would (the HA loop notices and repairs it)."""
    paths = settings.paths
    sandbox = Sandbox(paths.sandbox_dir)
    fleet = Fleet(sandbox.backdoor(load_fleet_config(paths.sandbox_hosts_file)), paths)
    try:
        info = next((g for g in fleet.guests() if g.name == args.guest), None)
        if info is None:
            raise NotFound(f"no guest named {args.guest!r} in the sandbox (see `pgcarve status --local`)")
        pid = SandboxFaults(sandbox).kill_guest(info.host, info.name)
    finally:
        fleet.close()
    out.print(f"killed QEMU of {info.name} on {info.host} (pid {pid}); watch GET /v1/incidents")
    return 0


def cmd_restart_libvirtd(args: argparse.Namespace, settings: Settings) -> int:
    """Stop a sandbox host's libvirtd and start it again; its guests keep running."""
    SandboxFaults(Sandbox(settings.paths.sandbox_dir)).restart_libvirtd(args.host)
    out.print(f"libvirtd on {args.host} restarted; its guests kept running")
    return 0


def cmd_host_fault(args: argparse.Namespace, settings: Settings) -> int:
    """kill-host, revive-host, partition, heal: one sandbox host at a time."""
    faults = SandboxFaults(Sandbox(settings.paths.sandbox_dir))
    if args.action == "kill-host":
        killed = faults.kill_host(args.host)
        out.print(f"{args.host}: killed {killed} process(es) (libvirtd, virtlogd, QEMU, ...); its primaries fail "
                  "over after recovery.host_timeout_s; `pgcarve sandbox revive-host` brings the host back")
    elif args.action == "revive-host":
        faults.revive_host(args.host)
        out.print(f"{args.host}: libvirtd and virtlogd run again; its guests stay off until the manager decides "
                  "(a former primary rejoins as a standby)")
    elif args.action == "partition":
        faults.partition(args.host)
        out.print(f"{args.host}: cut off from the other hosts (guests keep running); `pgcarve sandbox heal "
                  f"{args.host}` joins it again")
    else:
        faults.heal(args.host)
        out.print(f"{args.host}: joined to the other hosts again")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sandbox = sub.add_parser("sandbox", help="start/stop the private local libvirt hosts; inject faults into them")
    sandbox_sub = sandbox.add_subparsers(dest="action", required=True)
    up = sandbox_sub.add_parser("up", help="start N private hosts (network namespaces, each with its libvirtd)")
    up.add_argument("--hosts", type=int, default=1, help="number of sandbox hosts (1-8)")
    up.add_argument("--transport", choices=TRANSPORTS, default="unix",
                    help="unix: libvirt sockets and forwards from this machine; ssh: as on real hosts (qemu+ssh, "
                         "guests by address, the manager in a namespace of its own)")
    up.set_defaults(func=cmd_sandbox)
    run = sandbox_sub.add_parser("exec", help="run a command where the sandbox's manager runs (with --transport "
                                              "ssh: in its namespace), e.g. `pgcarve sandbox exec -- pgcarve up`")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    run.set_defaults(func=cmd_exec)
    publish = sandbox_sub.add_parser("publish", help="offer the manager namespace's API on 127.0.0.1 here")
    publish.add_argument("--port", type=int, default=8080, help="port on this machine's 127.0.0.1 (default 8080)")
    publish.add_argument("--target-port", type=int, default=None,
                         help="the API's port in the manager namespace (default: the same)")
    publish.set_defaults(func=cmd_publish)
    for name, text in (("down", "stop every guest, daemon and namespace of the sandbox, by PID"),
                       ("status", "is the sandbox up, with how many hosts")):
        sandbox_sub.add_parser(name, help=text).set_defaults(func=cmd_sandbox)
    kill = sandbox_sub.add_parser("kill-guest", help="kill -9 a guest's QEMU process, as a crash would")
    kill.add_argument("guest", help="guest name, e.g. pgc-01 or pgc-01-s1")
    kill.set_defaults(func=cmd_kill_guest)
    restart = sandbox_sub.add_parser("restart-libvirtd", help="restart a sandbox host's libvirtd under its guests")
    restart.add_argument("host", help="sandbox host name, e.g. h0")
    restart.set_defaults(func=cmd_restart_libvirtd)
    for action, text in (("kill-host", "kill every process of a sandbox host at once, as a power cut would"),
                         ("revive-host", "start a killed sandbox host's daemons again"),
                         ("partition", "cut a sandbox host off from the other hosts (its guests keep running)"),
                         ("heal", "join a partitioned sandbox host to the others again")):
        fault = sandbox_sub.add_parser(action, help=text)
        fault.add_argument("host", help="sandbox host name, e.g. h0")
        fault.set_defaults(func=cmd_host_fault)
