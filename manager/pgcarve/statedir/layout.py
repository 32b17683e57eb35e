"""What the state directory holds, and which of it the fleet cannot do without.

    <state>/secrets.json           the fleet's admin password: the manager's login on every guest
    <state>/tls/ca.key, ca.pem     the fleet CA: every guest's certificate chains to it
    <state>/tls/NAME.key, NAME.pem certificates it issued (the manager's etcd client, the API's)
    <state>/instances/NAME.json    each instance's passwords (application, replication, Patroni)
    <state>/api-token              the API's bearer token
    <state>/operations.json        the operation journal (what a restarted manager resumes)
    <state>/sync/NAME.json         each instance's synchronous set (which standbys may hold its commits)
    <state>/topology/HOST.xml      each host's CPUs, kept for when the host does not answer

Everything else there is rebuilt or belongs to one process: the guest image, the sandbox, the
servers' records and log, the lock, advice runs, the domain-type probe. Retirements are not here
at all: marker volumes on the hosts record them (control/retired.py).

The first five cannot be made again once guests use them: a new admin password or CA locks the
manager out of every guest, and without an instance's passwords its standbys cannot be rebuilt.
So they are made only for a new fleet (`make_fleet_secrets`, once control/state_check.py found no
guest), and `pgcarve state export` keeps all of the above (statedir/backup.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import StateMissing
from pgcarve.guest.credentials import create_credentials
from pgcarve.guest.tls import FleetCA
from pgcarve.settings import Paths

RESTORE = "pgcarve state import BACKUP --key-file KEY"  # how the messages say to restore

# A kept file's path relative to the state directory, and what it is. `secret`: written 0600.
_KEPT: tuple[tuple[re.Pattern[str], str, bool], ...] = (
    (re.compile(r"secrets\.json"), "the fleet's admin password", True),
    (re.compile(r"tls/ca\.key"), "the fleet CA's private key", True),
    (re.compile(r"tls/ca\.pem"), "the fleet CA's certificate", False),
    (re.compile(r"tls/[a-z0-9][a-z0-9_-]{0,63}\.key"), "a private key the fleet CA certified", True),
    (re.compile(r"tls/[a-z0-9][a-z0-9_-]{0,63}\.pem"), "a certificate from the fleet CA", False),
    (re.compile(r"instances/[a-z][a-z0-9-]{0,62}\.json"), "an instance's passwords", True),
    (re.compile(r"api-token"), "the API token", True),
    (re.compile(r"operations\.json"), "the operation journal", False),
    (re.compile(r"sync/[a-z][a-z0-9-]{0,62}\.json"), "an instance's synchronous set record", False),
    (re.compile(r"topology/[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\.xml"), "a host's CPU topology", False),
)
_GLOBS = ("secrets.json", "tls/*.key", "tls/*.pem", "instances/*.json", "api-token", "operations.json",
          "sync/*.json", "topology/*.xml")


@dataclass(frozen=True)
class KeptFile:
    """One file of the state directory that a backup keeps."""

    relative: str  # POSIX path inside the state directory
    what: str
    secret: bool  # holds a password or a private key: 0600

    @property
    def mode(self) -> int:
        return 0o600 if self.secret else 0o644


def kept_file(relative: str) -> KeptFile | None:
    """What `relative` is, if it is a file a backup keeps; None for anything else (and for any
    path that leaves the directory)."""
    for pattern, what, secret in _KEPT:
        if pattern.fullmatch(relative):
            return KeptFile(relative, what, secret)
    return None


def kept_files(paths: Paths) -> list[KeptFile]:
    """The kept files present in the state directory, in a stable order."""
    found: dict[str, KeptFile] = {}
    for pattern in _GLOBS:
        for path in sorted(paths.state_dir.glob(pattern)):
            relative = path.relative_to(paths.state_dir).as_posix()
            kept = kept_file(relative)
            if kept is not None and path.is_file() and not path.is_symlink():
                found.setdefault(relative, kept)
    return list(found.values())


def secret_files(paths: Paths) -> list[Path]:
    """Files of the state directory that hold a password or a private key (0600 whatever the umask)."""
    return [paths.state_dir / f.relative for f in kept_files(paths) if f.secret]


def recorded_instances(paths: Paths) -> list[str]:
    """Instances the state directory has passwords or a synchronous set record of: made by this
    fleet and not removed (removing an instance deletes both)."""
    names = {p.stem for p in paths.instance_secrets_dir.glob("*.json")}
    names |= {p.stem for p in (paths.state_dir / "sync").glob("*.json")}
    return sorted(names)


def unfinished_operations(paths: Paths) -> list[str]:
    """Operations the journal records as pending or running ("ID (KIND)"): work on the fleet that a
    manager would resume."""
    journal = paths.state_dir / "operations.json"
    try:
        records = json.loads(journal.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    if not isinstance(records, list):
        return []
    return [f"{r.get('id')} ({r.get('kind')})" for r in records
            if isinstance(r, dict) and r.get("status") in ("pending", "running")]


def missing_fleet_secrets(paths: Paths) -> list[str]:
    """The fleet-wide secrets the state directory lacks, each as "FILE (what it is)"."""
    ca = FleetCA(paths.tls_dir)
    return [f"{path} ({what})" for path, what in ((paths.secrets_file, "the fleet's admin password"),
                                                  (ca.key_file, "the fleet CA's key"),
                                                  (ca.cert_file, "the fleet CA's certificate"))
            if not path.exists()]


def make_fleet_secrets(paths: Paths) -> list[str]:
    """Make the admin password and the CA that the state directory lacks; what was made. Only for a
    fleet proven to have no guest (control/state_check.py): nothing else calls it."""
    made = []
    if not paths.secrets_file.exists():
        create_credentials(paths.secrets_file)
        made.append(f"{paths.secrets_file} (a new fleet admin password)")
    ca = FleetCA(paths.tls_dir)
    if not ca.exists():
        ca.create()
        made.append(f"{ca.key_file} and {ca.cert_file} (a new fleet CA)")
    return made


def make_fleet_ca_if_new(paths: Paths) -> str | None:
    """The fleet CA for a new fleet, where only the state directory can tell (the sandbox before its
    hosts run, `pgcarve etcd-certificate` with no hosts file): made unless it exists (None then), or
    StateMissing if the state directory records instances or unfinished operations, which depend on
    the CA that is missing."""
    ca = FleetCA(paths.tls_dir)
    if ca.exists():
        return None
    traces = [f"instances {', '.join(names)}" for names in [recorded_instances(paths)] if names]
    traces += [f"unfinished operations {', '.join(ops)}" for ops in [unfinished_operations(paths)] if ops]
    if traces:
        raise StateMissing(
            f"the state directory {paths.state_dir} records {'; '.join(traces)} but lacks the fleet CA "
            f"({ca.key_file}, {ca.cert_file}): a new one would chain to none of their certificates, so none is made. "
            f"Restore it with `{RESTORE}`, or, if that fleet is gone for good, move {paths.instance_secrets_dir} "
            f"and {paths.state_dir / 'sync'} away first")
    ca.create()
    return f"{ca.key_file} and {ca.cert_file} (a new fleet CA)"
