"""`pgcarve state export` / `import`: the state directory's kept files (statedir/layout.py), and the
manager's etcd client files when they live elsewhere, in one encrypted archive (statedir/archive.py).

Export reads; it never changes the state directory. Import decides first (`plan_import`: each file
new, the same, or different from what is there) and writes only if nothing differs (or `force`),
every file 0600 (0644 for certificates and records) whatever the umask, each atomically (a new
file renamed over the old). A wrong key, a changed archive, a file the archive should not hold,
or a difference without `force`: an error, and nothing written.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pgcarve.config import FleetConfig
from pgcarve.errors import ConfigError, Conflict
from pgcarve.guest.credentials import Credentials
from pgcarve.guest.tls import KeyAndCertificate, check_ca_pair
from pgcarve.settings import Paths
from pgcarve.statedir import layout
from pgcarve.statedir.archive import ArchiveUnreadable, seal, unseal

FORMAT = 1


@dataclass(frozen=True)
class Entry:
    """One file of an archive: inside the state directory (`relative`), or, for the manager's etcd
    client files kept elsewhere, at an absolute path (`external`)."""

    path: str  # relative to the state directory, or absolute when external
    what: str
    mode: int
    data: bytes
    external: bool = False

    def target(self, paths: Paths) -> Path:
        return Path(self.path) if self.external else paths.state_dir / self.path


@dataclass(frozen=True)
class Bundle:
    """What an archive holds."""

    fleet: str | None  # the hosts file's fleet name at export, if one was found
    exported_at: float
    state_dir: str
    entries: tuple[Entry, ...]


def _etcd_files(config: FleetConfig | None, paths: Paths) -> list[tuple[Path, str, int]]:
    """The etcd client files the hosts file names, where they are outside the state directory."""
    if config is None or config.etcd is None:
        return []
    etcd = config.etcd
    named = [(Path(etcd.ca_file), "the CA etcd's certificates are checked against", 0o644),
             (Path(etcd.cert_file), "the manager's etcd client certificate", 0o644),
             (Path(etcd.key_file), "the manager's etcd client key", 0o600)]
    state = paths.state_dir.resolve()
    return [(p, what, mode) for p, what, mode in named if not p.resolve().is_relative_to(state)]


def collect(paths: Paths, config: FleetConfig | None) -> Bundle:
    """Read what a backup keeps. ConfigError if the state directory lacks the fleet's admin password or
    its CA (no fleet to back up), or if an etcd file the hosts file names cannot be read."""
    missing = layout.missing_fleet_secrets(paths)
    if missing:
        raise ConfigError(f"nothing to export: the state directory {paths.state_dir} lacks {'; '.join(missing)} "
                          "(set PGCARVE_STATE_DIR to the fleet's state directory)")
    entries = [Entry(f.relative, f.what, f.mode, (paths.state_dir / f.relative).read_bytes())
               for f in layout.kept_files(paths)]
    for path, what, mode in _etcd_files(config, paths):
        try:
            entries.append(Entry(str(path), what, mode, path.read_bytes(), external=True))
        except OSError as exc:
            raise ConfigError(f"{path} ({what}, named in the hosts file's etcd section) cannot be read: "
                              f"{exc.strerror}") from None
    return Bundle(config.fleet if config else None, time.time(), str(paths.state_dir), tuple(entries))


def _payload(bundle: Bundle) -> bytes:
    return json.dumps({
        "format": FORMAT, "fleet": bundle.fleet, "exported_at": bundle.exported_at, "state_dir": bundle.state_dir,
        "files": [{"path": e.path, "what": e.what, "mode": e.mode, "external": e.external,
                   "data": base64.b64encode(e.data).decode()} for e in bundle.entries],
    }).encode()


def _write_new(path: Path, data: bytes, mode: int) -> Path:
    """`data` in a new file beside `path`, of `mode` whatever the umask, on disk; its path."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def export_state(paths: Paths, config: FleetConfig | None, archive_file: Path, fleet_key: bytes) -> Bundle:
    """Write the archive (0600, atomically: a reader never sees half of it); what it holds."""
    bundle = collect(paths, config)
    archive_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_new(archive_file, seal(_payload(bundle), fleet_key), 0o600)
    tmp.replace(archive_file)
    return bundle


def _entry(doc: object, where: str) -> Entry:
    """One file record of an archive, checked: a known kind of file at a path that stays inside the
    state directory, or an absolute etcd file path."""
    if not isinstance(doc, dict) or not isinstance(doc.get("path"), str) or not isinstance(doc.get("data"), str):
        raise ArchiveUnreadable(f"{where} holds a file record that is not one: {str(doc)[:80]!r}")
    path, external = doc["path"], bool(doc.get("external"))
    data = base64.b64decode(doc["data"], validate=True)
    if external:
        pure = PurePosixPath(path)
        if not pure.is_absolute() or ".." in pure.parts or str(pure) != path:
            raise ArchiveUnreadable(f"{where} names {path!r} for an etcd file: not a plain absolute path")
        mode = 0o600 if doc.get("mode") == 0o600 else 0o644
        return Entry(path, str(doc.get("what", "an etcd file")), mode, data, external=True)
    kept = layout.kept_file(path)
    if kept is None:
        raise ArchiveUnreadable(f"{where} holds {path!r}, which is no file of a state directory pgcarve keeps")
    return Entry(path, kept.what, kept.mode, data)


def read_archive(archive_file: Path, fleet_key: bytes) -> Bundle:
    """The archive's contents, checked (ArchiveUnreadable otherwise): every path one pgcarve keeps,
    the admin password and CA present and whole."""
    where = str(archive_file)
    try:
        sealed = archive_file.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no archive at {archive_file}") from None
    try:
        doc = json.loads(unseal(sealed, fleet_key, where))
    except (ValueError, UnicodeDecodeError):
        raise ArchiveUnreadable(f"{where} opened, but what it holds is not a state archive's contents") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), list):
        found = doc.get("format") if isinstance(doc, dict) else "?"
        raise ArchiveUnreadable(f"{where} is a state archive of format {found}; this pgcarve reads format {FORMAT}")
    try:
        entries = tuple(_entry(f, where) for f in doc["files"])
    except ValueError:
        raise ArchiveUnreadable(f"{where} holds a file whose contents are not base64") from None
    by_path = {e.path: e for e in entries}
    if len(by_path) != len(entries):
        raise ArchiveUnreadable(f"{where} holds a file twice")
    for needed in ("secrets.json", "tls/ca.key", "tls/ca.pem"):
        if needed not in by_path:
            raise ArchiveUnreadable(f"{where} lacks {needed}: it is no backup of a fleet")
    try:
        Credentials(admin_password=json.loads(by_path["secrets.json"].data)["admin_password"])
    except (ValueError, KeyError, TypeError, ConfigError):
        raise ArchiveUnreadable(f"{where}: its secrets.json holds no admin password") from None
    check_ca_pair(KeyAndCertificate(by_path["tls/ca.key"].data, by_path["tls/ca.pem"].data), f"the fleet CA in {where}")
    fleet = doc.get("fleet")
    return Bundle(fleet if isinstance(fleet, str) else None, float(doc.get("exported_at") or 0),
                  str(doc.get("state_dir") or ""), entries)


@dataclass(frozen=True)
class ImportPlan:
    """What an import would do: files to write (absent, or `different` and forced) and files already
    the same."""

    new: tuple[Entry, ...]
    same: tuple[Entry, ...]
    different: tuple[Entry, ...]


def plan_import(paths: Paths, bundle: Bundle) -> ImportPlan:
    """Compare the archive with what is there (nothing is written)."""
    new: list[Entry] = []
    same: list[Entry] = []
    different: list[Entry] = []
    for entry in bundle.entries:
        target = entry.target(paths)
        try:
            current = target.read_bytes()
        except FileNotFoundError:
            new.append(entry)
            continue
        (same if current == entry.data else different).append(entry)
    return ImportPlan(tuple(new), tuple(same), tuple(different))


def check_fleet_name(bundle: Bundle, config: FleetConfig | None, where: str) -> None:
    """Conflict if the hosts file names another fleet than the one the archive was exported from."""
    if config is not None and bundle.fleet is not None and config.fleet != bundle.fleet:
        raise Conflict(f"{where} is the state of fleet {bundle.fleet!r}, but the hosts file names fleet "
                       f"{config.fleet!r}: nothing imported (use that fleet's hosts file, or that fleet's backup)")


def differences(plan: ImportPlan, paths: Paths) -> str:
    """Words for the files that differ, for a refusal."""
    return "\n".join(f"  - {e.target(paths)} ({e.what})" for e in plan.different)


def apply_import(paths: Paths, plan: ImportPlan, force: bool) -> list[Entry]:
    """Write the plan's files (and, with `force`, the different ones over what is there); what was
    written. Conflict, with nothing written, if files differ without `force`."""
    if plan.different and not force:
        raise Conflict(f"nothing imported: {len(plan.different)} file(s) of the state directory differ from the "
                       f"archive's (another fleet's, or a newer state than the backup):\n{differences(plan, paths)}\n"
                       "Compare them first; --force replaces them with the archive's")
    writing: Sequence[Entry] = [*plan.new, *(plan.different if force else ())]
    staged: list[tuple[Path, Path]] = []
    try:
        for entry in writing:
            target = entry.target(paths)
            private_dir = entry.path.startswith("instances/")
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if private_dir else 0o755)
            staged.append((_write_new(target, entry.data, entry.mode), target))
    except BaseException:
        for tmp, _target in staged:
            tmp.unlink(missing_ok=True)
        raise
    # Every file is written whole before any is renamed into place.
    for tmp, target in staged:
        tmp.replace(target)
    return list(writing)
