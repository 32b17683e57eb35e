"""Commands around the API server: start/stop it, run it, and ask it to scale.

The command line never imports the API package (which imports the manager): `serve` runs
`python -m pgcarve_api` in its place, and `server start` starts that in the background.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pgcarve.cli.client import ApiClient, read_server, server_verify
from pgcarve.cli.display import console, out, send_and_follow
from pgcarve.control.manager_lock import running_servers
from pgcarve.errors import PgcarveError
from pgcarve.processes import ProcessRecord, ProcessStatus, read_record, stale_reason, stop
from pgcarve.settings import Paths, Settings


def serve_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "pgcarve_api", "--bind", args.bind, "--port", str(args.port)]
    if args.hosts_file:
        command += ["--hosts-file", args.hosts_file]
    return command


def cmd_serve(args: argparse.Namespace, _settings: Settings) -> int:
    """Run the API server in this process's place (same PID, same environment)."""
    command = serve_command(args)
    os.execv(command[0], command)  # noqa: S606  (our own interpreter and arguments)
    return 0  # not reached


def cmd_server(args: argparse.Namespace, settings: Settings) -> int:
    """Start the API server in the background (its record in server.json and servers/), or stop
    every server of this state directory by those records."""
    paths = settings.paths
    if args.action == "stop":
        stop_servers(paths)
        return 0
    server = read_server(paths)
    running = [data for _record, data in running_servers(paths.servers_dir)]
    same_port = [d for d in running if d.get("port") == args.port]
    if same_port or (server is not None and not running):  # (a server from before servers/ existed)
        found = same_port[0] if same_port else server
        assert found is not None
        out.print(f"server: already running at {found['url']} (pid {found['pid']})")
        return 0
    log_path = paths.state_dir / "server.log"
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(serve_command(args), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    # The server writes its URL (https off loopback) and CA into server.json once it is set up.
    client = ApiClient(f"http://{args.bind}:{args.port}")
    deadline = time.monotonic() + 60
    while True:
        started = read_server(paths)
        if started is not None and started.get("pid") == proc.pid:
            client = ApiClient(started["url"], verify=server_verify(started))
            if client.healthy():
                break
        if proc.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            reason = f": {lines[-1][-400:]}" if lines else ""
            raise PgcarveError(f"the API server exited at start (code {proc.returncode}){reason} (log: {log_path})")
        if time.monotonic() > deadline:
            raise PgcarveError(f"the API server did not answer on {client.url} within 60 s; see {log_path}")
        time.sleep(0.2)
    out.print(f"server: API and dashboard on {client.url}/ (pid {proc.pid}, log {log_path})")
    out.print(f"server: API token in {paths.token_file} (send it as 'Authorization: Bearer <token>')")
    return 0


def stop_servers(paths: Paths) -> None:
    """Stop every server this state directory records (servers/ and server.json), by their
    process records: a PID that is no longer the server is never signalled."""
    records: dict[int, tuple[ProcessRecord | None, dict[str, Any], Path]] = {}
    for path in [paths.server_file, *sorted(paths.servers_dir.glob("*.json"))] if paths.servers_dir.is_dir() \
            else [paths.server_file]:
        record, data = read_record(path)
        if data:
            records.setdefault(int(data.get("pid", 0) or 0), (record, data, path))
    if not records:
        out.print("server: not running")
    for pid, (record, data, path) in sorted(records.items()):
        if record is None:  # written by an older pgcarve: a bare PID cannot be verified
            out.print(f"server: {path} names pid {pid} without its start time, so it was not signalled "
                      "(it may be another process by now); if it is the pgcarve server, stop it by hand")
            continue
        status = stop(record, timeout_s=20)
        if status is ProcessStatus.RUNNING:
            out.print(f"server: stopped (pid {record.pid}, {data.get('url', 'no URL')})")
        else:
            out.print(f"server: not running: {stale_reason(record, status)}, so it was not signalled")
    for _pid, (_record, _data, path) in records.items():
        path.unlink(missing_ok=True)


def cmd_scale(args: argparse.Namespace, settings: Settings) -> int:
    client = ApiClient.for_settings(settings, args.url)
    op = send_and_follow(client, lambda: client.put("/v1/scale", {"instances": args.instances}), "scale",
                         f"scale to {args.instances}", args.no_wait)
    if isinstance(op, int):
        return op
    if op["status"] == "failed":
        console.print(f"[red]scale failed: {op['error']}")
        return 1
    out.print(f"scaled to {args.instances} instance(s): {op.get('message') or ''}")
    return 0
