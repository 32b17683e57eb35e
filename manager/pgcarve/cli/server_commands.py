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

from pgcarve.cli.client import ApiClient, read_server, server_verify
from pgcarve.cli.display import console, out, send_and_follow
from pgcarve.errors import PgcarveError
from pgcarve.processes import ProcessStatus, read_record, stale_reason, stop
from pgcarve.settings import Settings


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
    """Start the API server in the background (pid in server.json), or stop it by that pid."""
    paths = settings.paths
    if args.action == "stop":
        record, data = read_record(paths.server_file)
        if not data:
            out.print("server: not running")
        elif record is None:  # written by an older pgcarve: a bare PID cannot be verified
            out.print(f"server: {paths.server_file} names pid {data.get('pid')} without its start time, so it "
                      "was not signalled (it may be another process by now); if it is the pgcarve server, "
                      "stop it by hand")
        else:
            status = stop(record, timeout_s=20)
            if status is ProcessStatus.RUNNING:
                out.print(f"server: stopped (pid {record.pid})")
            else:
                out.print(f"server: not running: {stale_reason(record, status)}, so it was not signalled")
        paths.server_file.unlink(missing_ok=True)
        return 0
    server = read_server(paths)
    if server is not None:
        out.print(f"server: already running at {server['url']} (pid {server['pid']})")
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
