"""Backups by hand (`pgcarve backup`, POST /v1/instances/{name}/backups) and each instance's
catalog (GET .../backups): the backup tool's commands run in the instance's primary through its
guest agent (virt/agent.py), their command lines and output owned by backup/pgbackrest.py.

Taken on the primary for now: a backup from a standby (pgBackRest's backup-standby) needs the tool
to reach the primary and the standby both, over its own protocol between guests, which the fleet
does not set up yet. The primary copies the files; WAL is archived by whichever guest is primary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pgcarve.backup import pgbackrest
from pgcarve.backup.catalog import BackupRecord, BackupType, StanzaCatalog
from pgcarve.control.fleet import Fleet, Guest, Instance
from pgcarve.control.operations import Operation, OperationQueue
from pgcarve.control.roles_guard import refuse
from pgcarve.errors import ConfigError, GuestCommandFailed, GuestNotReady
from pgcarve.virt.agent import run_in_guest

BACKUP_TIMEOUT_S = 3600.0
SHORT_TIMEOUT_S = 180.0  # stanza-create, check (waits up to its archive-timeout), info
RUN_AS = "postgres"  # archive_command's user: the repository key and spool are its

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class BackupTaken:
    record: BackupRecord
    guest: str
    catalog: StanzaCatalog


class Backups:
    """The backup tool's commands for one fleet's instances."""

    def __init__(self, fleet: Fleet, operations: OperationQueue):
        self.fleet = fleet
        self.operations = operations
        operations.runners["backup"] = self.run  # reads the fleet, changes nothing: no refresh after

    # -- requests (the API's) ------------------------------------------------------------------

    def request(self, name: str, kind: str) -> Operation:
        """Queue a backup of instance `name` (full, diff or incr): NotFound for no such instance,
        ConfigError for another type or a fleet without a backup section, RolesMismatch for an
        instance pgcarve does not act on, before anything runs."""
        backup_type = self.type_of(kind)
        inst = self.fleet.instance(name, with_endpoints=False)
        refuse(inst.roles_mismatch)
        return self.operations.submit("backup", inst.index, {"instance": inst.name, "type": backup_type.value})

    def catalog_of(self, name: str) -> StanzaCatalog:
        """Instance `name`'s backups and recoverable window, read from the repository; in a fleet
        without a backup section, none (its status says why)."""
        inst = self.fleet.instance(name, with_endpoints=False)
        if self.fleet.config.backup is None:
            return StanzaCatalog(name=inst.name, status="not backed up: the hosts file has no backup section",
                                 backups=(), wal=())
        return self.catalog(inst)

    def run(self, op: Operation) -> str:
        """A queued backup (kind "backup"): progress as its steps go, its result the new backup."""
        name, kind = str(op.params["instance"]), BackupType(str(op.params["type"]))

        def progress(step: str, fraction: float) -> None:
            self.operations.update(op, progress=round(min(0.99, fraction), 3), message=f"{name}: {step}",
                                   steps={name: {"step": step, "fraction": round(fraction, 3)}})

        taken = self.take(self.fleet.instance(name, with_endpoints=False), kind, progress)
        record, window = taken.record, taken.catalog.window
        self.operations.update(op, result={
            "instance": name, "label": record.label, "type": record.type.value, "guest": taken.guest,
            "started_at": record.started_at, "stopped_at": record.stopped_at, "size_bytes": record.size_bytes,
            "repository_bytes": record.repository_bytes, "wal_start": record.wal_start,
            "wal_stop": record.wal_stop, "recoverable_from": window.earliest if window else None})
        return (f"{record.type.value} backup {record.label} of {name} taken on {taken.guest}: "
                f"{record.size_bytes / 2**20:.1f} MiB in {record.stopped_at - record.started_at:.0f} s")

    # -- the tool's commands -------------------------------------------------------------------

    def type_of(self, kind: str) -> BackupType:
        """The backup type named `kind`, once the fleet is backed up at all; ConfigError otherwise."""
        try:
            backup_type = BackupType(kind)
        except ValueError:
            raise ConfigError(f"backup type {kind!r} is not one of full, diff, incr") from None
        self._require_configured()
        return backup_type

    def _require_configured(self) -> None:
        if self.fleet.config.backup is None:
            raise ConfigError("the hosts file has no backup section: instances are not backed up "
                              "(see hosts.sample.yaml, backup)")

    def _guest(self, inst: Instance) -> Guest:
        primary = inst.primary
        if primary is None or primary.info.state != "running":
            raise GuestNotReady(f"{inst.name} has no running primary to run the backup tool in")
        return primary

    def _run(self, guest: Guest, argv: Sequence[str], timeout_s: float) -> str:
        result = run_in_guest(self.fleet.hosts[guest.info.host], guest.name, argv, timeout_s, user=RUN_AS)
        if result.exit_code != 0:
            words = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
            raise GuestCommandFailed(f"{guest.name}: `{pgbackrest.as_shell(argv)}` exited {result.exit_code}: "
                                     + " / ".join(words[-4:])[:800])
        return result.stdout

    def catalog(self, inst: Instance) -> StanzaCatalog:
        """The instance's backups, archived WAL and recoverable window, as the repository has them."""
        self._require_configured()
        text = self._run(self._guest(inst), pgbackrest.info(inst.name), SHORT_TIMEOUT_S)
        try:
            return pgbackrest.parse_info(text, inst.name)
        except ValueError as exc:
            raise GuestCommandFailed(f"{inst.name}: the backup catalog could not be read: {exc}") from None

    def take(self, inst: Instance, kind: BackupType, progress: Progress) -> BackupTaken:
        """Make sure the instance's stanza exists and archiving works, then take a backup; the new
        backup's record. A diff or incr without a full backup before it becomes a full one (the
        tool's rule), and the record says so. RolesMismatch for an instance pgcarve does not act on."""
        refuse(inst.roles_mismatch)
        self._require_configured()
        guest = self._guest(inst)
        progress("creating the stanza (if new)", 0.05)
        self._run(guest, pgbackrest.stanza_create(inst.name), SHORT_TIMEOUT_S)
        progress("checking WAL archiving", 0.15)
        self._run(guest, pgbackrest.check(inst.name), SHORT_TIMEOUT_S)
        progress(f"taking a {kind.value} backup", 0.3)
        before = {b.label for b in self.catalog(inst).backups}
        self._run(guest, pgbackrest.backup(inst.name, kind), BACKUP_TIMEOUT_S)
        progress("reading the catalog", 0.95)
        catalog = self.catalog(inst)
        new = [b for b in catalog.backups if b.label not in before]
        if not new:
            raise GuestCommandFailed(f"{inst.name}: the backup finished but the catalog lists no new backup")
        return BackupTaken(record=new[-1], guest=guest.name, catalog=catalog)

