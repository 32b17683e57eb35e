"""`python -m pgcarve_api` (what `pgcarve serve` runs): the API under uvicorn, recording where
it listens in the state directory's server.json.

Everything that can refuse a start (another manager acting from this state directory, a fleet
whose guests run while the state directory lacks its admin password or CA, the token, the token
file's mode, the fleet CA, the address, the TLS settings, PGCARVE_ALLOWED_HOSTS) is checked
before the socket listens and before server.json is written. server.json records this process
(PID, start time, boot: pgcarve.processes), so `pgcarve server stop` never signals a PID that is
no longer this server; its `url` says https when the server speaks it, and `ca_file` what to
verify it with.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pgcarve.config import load_fleet_config
from pgcarve.control.fleet import Fleet
from pgcarve.control.manager_lock import ManagerLock, running_servers
from pgcarve.control.state_check import prepare_state
from pgcarve.errors import PgcarveError
from pgcarve.processes import read_record, record_self, write_record

from pgcarve_api.https import server_tls
from pgcarve_api.listener import bind_listener
from pgcarve_api.main import create_app
from pgcarve_api.security import load_or_create_token
from pgcarve_api.settings import Settings


def serve(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    paths = settings.paths
    config = load_fleet_config(settings.hosts_file_path())
    # Before anything else: without etcd, a second server on this state directory would fight the
    # first over the same guests (discard what it builds, repair what it removes), so it is refused.
    # With etcd, servers share the lock and the fleet's lease decides which one acts
    # (control/leadership.py); `pgcarve up` and the like are still refused while any runs.
    lock = ManagerLock(paths.state_dir, "pgcarve serve", shared=config.etcd is not None and config.etcd.manager_lease)
    lock.acquire()
    fleet = Fleet(config, paths)
    try:
        prepare_state(fleet)  # before anything is made: the token, server.json
    finally:
        fleet.close()
    token, created = load_or_create_token(settings.token, paths.token_file)
    sock, listener = bind_listener(settings.bind, settings.port)
    try:
        app = create_app(settings, listener=listener)
        tls = server_tls(settings, app.state.fleet_ca, listener, app.state.server_names)
    except BaseException:
        sock.close()
        raise
    if created and sys.stderr.isatty():
        # Shown once, on first start, to a person at a terminal; never written into a log file.
        print(f"pgcarve: new API token (also in {paths.token_file}): {token}", file=sys.stderr, flush=True)
    elif created:
        print(f"pgcarve: new API token written to {paths.token_file} (mode 0600)", file=sys.stderr, flush=True)
    url = f"{'https' if tls else 'http'}://{listener.local_url_host()}:{listener.port}"
    uvicorn_config = uvicorn.Config(app, log_level="info", access_log=False,
                            ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None)
    app.state.url = settings.advertise_url or url  # the leader key names it (the campaign starts in run())
    me = record_self()
    names = app.state.server_names.all()
    fields = {"url": url, "ca_file": str(tls.ca_file) if tls and tls.ca_file else None, "names": names,
              "port": listener.port}
    # Every server has its record in servers/ (so `server stop` finds them all); server.json names
    # the latest, for clients.
    own = paths.servers_dir / f"{me.pid}.json"
    write_record(own, me, **fields)
    write_record(paths.server_file, me, **fields)
    lock.note(url=url)
    logging.getLogger("pgcarve.api").info("serving %s; names accepted in Host: %s", url, ", ".join(names))
    try:
        uvicorn.Server(uvicorn_config).run(sockets=[sock])
    finally:
        own.unlink(missing_ok=True)
        if read_record(paths.server_file)[0] == me:  # not a file another server wrote since
            others = running_servers(paths.servers_dir)
            if others:  # clients go on to a server still running, never to this stopped one
                write_record(paths.server_file, others[-1][0], **{k: v for k, v in others[-1][1].items()
                                                                  if k not in others[-1][0].to_dict()})
            else:
                paths.server_file.unlink(missing_ok=True)
        lock.release()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pgcarve_api", description="pgcarve's REST API and dashboard")
    parser.add_argument("--bind", help="address to listen on (PGCARVE_BIND, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (PGCARVE_PORT, default 8080)")
    parser.add_argument("--hosts-file", help="hosts.yaml (PGCARVE_HOSTS_FILE, else ./hosts.yaml, else the sandbox's)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("bind", args.bind), ("port", args.port), ("hosts_file", args.hosts_file))
                 if v is not None}
    try:
        return serve(Settings(**overrides))
    except PgcarveError as exc:  # a refused start: the reason, for an operator, and no traceback
        print(f"pgcarve: the API server did not start: {exc}", file=sys.stderr, flush=True)
        return 2
