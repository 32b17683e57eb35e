"""`pgcarve state export FILE` / `pgcarve state import FILE`: a backup of what only the state
directory holds (the fleet's admin password and CA, each instance's passwords, the operation
journal, ...; statedir/layout.py lists it), encrypted with the operator's fleet key
(`--key-file`, or PGCARVE_FLEET_KEY_FILE)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pgcarve.cli.client import read_server
from pgcarve.cli.display import console, out
from pgcarve.config import FleetConfig, load_fleet_config
from pgcarve.control.manager_lock import ManagerLock
from pgcarve.errors import ConfigError, Conflict
from pgcarve.settings import Settings
from pgcarve.statedir import backup
from pgcarve.statedir.archive import read_fleet_key


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    state = sub.add_parser("state", help="back up or restore what only the state directory holds (encrypted)")
    state_sub = state.add_subparsers(dest="action", required=True)
    export = state_sub.add_parser("export", help="write the fleet's secrets, CA, journal and records to FILE, "
                                                 "encrypted with the fleet key")
    export.add_argument("file", help="the archive to write (0600; replaced if it exists)")
    export.set_defaults(func=cmd_export)
    restore = state_sub.add_parser("import", help="restore an archive into the state directory; refused where "
                                                  "files differ unless --force")
    restore.add_argument("file", help="an archive `pgcarve state export` wrote")
    restore.add_argument("--force", action="store_true",
                         help="replace files of the state directory that differ from the archive's")
    restore.set_defaults(func=cmd_import)
    for parser in (export, restore):
        parser.add_argument("--key-file", help="the fleet key (default: PGCARVE_FLEET_KEY_FILE); a file of 16 to "
                                               "4096 bytes, mode 0600")


def _fleet_key(args: argparse.Namespace, settings: Settings) -> bytes:
    path = args.key_file or settings.fleet_key_file
    if not path:
        raise ConfigError("no fleet key: give --key-file FILE or set PGCARVE_FLEET_KEY_FILE (make one with "
                          "`head -c 32 /dev/urandom | base64 > fleet.key && chmod 600 fleet.key`, and keep a copy "
                          "apart from the archives)")
    return read_fleet_key(Path(path))


def _hosts_config(args: argparse.Namespace, settings: Settings) -> FleetConfig | None:
    """The hosts file's config, if there is one (its fleet name, its etcd client files)."""
    path = settings.hosts_file_path(args.hosts_file)
    return load_fleet_config(path) if path.exists() else None


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    key = _fleet_key(args, settings)
    archive = Path(args.file)
    bundle = backup.export_state(settings.paths, _hosts_config(args, settings), archive, key)
    kinds: dict[str, int] = {}
    for entry in bundle.entries:
        kinds[entry.what] = kinds.get(entry.what, 0) + 1
    for what, count in kinds.items():
        out.print(f"  {count:>4} x {what}")
    external = [e.path for e in bundle.entries if e.external]
    if external:
        out.print(f"  and the etcd client files the hosts file names: {', '.join(external)}")
    out.print(f"exported the state of {settings.paths.state_dir}"
              f"{f' (fleet {bundle.fleet})' if bundle.fleet else ''} to {archive} ({archive.stat().st_size:,} bytes, "
              "mode 0600), encrypted with the fleet key: keep the archive and the key in different places")
    return 0


def cmd_import(args: argparse.Namespace, settings: Settings) -> int:
    key = _fleet_key(args, settings)
    paths = settings.paths
    server = read_server(paths)
    if server is not None:
        raise Conflict(f"nothing imported: a pgcarve server (pid {server['pid']}, {server['url']}) uses "
                       f"{paths.state_dir}; stop it first (`pgcarve server stop`)")
    bundle = backup.read_archive(Path(args.file), key)  # a wrong key or a changed byte stops here
    backup.check_fleet_name(bundle, _hosts_config(args, settings), args.file)
    with ManagerLock(paths.state_dir, "pgcarve state import"):
        plan = backup.plan_import(paths, bundle)
        written = backup.apply_import(paths, plan, force=args.force)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(bundle.exported_at))
    for entry in written:
        console.print(f"restored {entry.target(paths)} ({entry.what})")
    out.print(f"imported {args.file} (exported {when}{f', fleet {bundle.fleet}' if bundle.fleet else ''}) into "
              f"{paths.state_dir}: {len(written)} file(s) written, {len(plan.same)} already the same"
              f"{f', {len(plan.different)} replaced (--force)' if args.force and plan.different else ''}")
    return 0
