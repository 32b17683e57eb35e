"""A manager never makes the fleet's secrets anew over a running fleet.

The fleet's admin password, its CA and each instance's passwords exist only in the state directory
(and in a backup of it: `pgcarve state export`). Made anew while guests run, they lock the manager
out of every guest (a password no guest knows, a CA no guest's certificate chains to) and leave
standbys that can no longer be rebuilt. So a manager that finds the fleet in use while the state
directory lacks them refuses to start, names what is missing and how to restore it, and makes
nothing. The fleet is in use when any of these exists: guests of the fleet on a host (libvirt
domains with pgcarve's metadata), retired instances' disks, instances the state directory records
(passwords, synchronous set records), unfinished operations in the journal. Only a fleet with none
of them, every host having answered, gets new secrets (`prepare_state`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pgcarve.control.fleet import Fleet
from pgcarve.control.retired import retired_instances
from pgcarve.errors import StateMissing
from pgcarve.statedir import layout
from pgcarve.statedir.modes import tighten_secret_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetInUse:
    """What shows that the fleet exists (each list sorted); empty lists everywhere: a new fleet."""

    guests: tuple[str, ...]  # guest names on the hosts that answered
    retired: tuple[str, ...]  # retired instances (disks kept on a host)
    recorded: tuple[str, ...]  # instances the state directory has passwords or records of
    operations: tuple[str, ...]  # unfinished operations in the journal
    unreachable: tuple[str, ...]  # hosts that did not answer: whether guests run there is unknown
    from_guests: tuple[str, ...] = ()  # instances the guests belong to

    @property
    def instances(self) -> tuple[str, ...]:
        """Instances with guests or kept disks on a host: the ones whose passwords must be there."""
        return tuple(sorted({*self.from_guests, *self.retired}))

    def evidence(self) -> list[str]:
        """Words for what was found, for an error message."""
        found = []
        for label, names in (("guests", self.guests), ("retired instances", self.retired),
                             ("instances recorded in the state directory", self.recorded),
                             ("unfinished operations", self.operations)):
            if names:
                shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
                found.append(f"{label} ({shown})")
        return found


def fleet_in_use(fleet: Fleet) -> FleetInUse:
    """Look on every host and in the state directory for signs of the fleet (nothing is changed)."""
    guests = fleet.guests()
    unreachable = tuple(sorted(fleet.unreachable_hosts()))
    retired = tuple(sorted(r.name for r in retired_instances(fleet)))
    return FleetInUse(guests=tuple(sorted(g.name for g in guests if g.state != "unreachable")),
                      retired=retired, recorded=tuple(layout.recorded_instances(fleet.paths)),
                      operations=tuple(layout.unfinished_operations(fleet.paths)), unreachable=unreachable,
                      from_guests=tuple(sorted({g.metadata.cluster for g in guests})))


def _refuse(fleet: Fleet, found: FleetInUse, missing: list[str]) -> None:
    state_dir = fleet.paths.state_dir
    listed = "\n  - ".join(missing)
    if found.evidence():
        why = f"fleet {fleet.config.fleet!r} is in use ({'; '.join(found.evidence())})"
    else:
        why = (f"hosts {', '.join(found.unreachable)} do not answer, so whether guests of fleet "
               f"{fleet.config.fleet!r} run there cannot be told")
    only_records = found.recorded and not (found.guests or found.retired or found.operations)
    raise StateMissing(
        f"{why}, but the state directory {state_dir} lacks:\n  - {listed}\n"
        "New ones would lock the manager out of the guests that use the old ones, so none are made and nothing "
        f"was changed. Restore them from the fleet's state backup: `{layout.RESTORE}` (with "
        f"PGCARVE_STATE_DIR={state_dir}), or point PGCARVE_STATE_DIR at the directory that has them"
        + (f". If that fleet is gone for good (no guest, no kept disk), move {fleet.paths.instance_secrets_dir} "
           f"and {state_dir / 'sync'} away to start a new one" if only_records else ""))


def _missing(fleet: Fleet, found: FleetInUse) -> list[str]:
    missing = layout.missing_fleet_secrets(fleet.paths)
    return missing + [f"{fleet.paths.instance_secrets_dir / (name + '.json')} (instance {name}'s passwords)"
                      for name in found.instances if not fleet.secrets.exists(name)]


def check_state(fleet: Fleet) -> FleetInUse:
    """For every command that uses the fleet, at its start: files holding secrets that group or others
    could read are made 0600 again, and said so (statedir/modes.py); then StateMissing if the fleet is
    in use while the state directory lacks its admin password, its CA, or the passwords of an
    instance that has guests or kept disks. Nothing else is made or changed. Returns what was found
    of the fleet."""
    tighten_secret_files(fleet.paths)
    found = fleet_in_use(fleet)
    if found.evidence():
        missing = _missing(fleet, found)
        if missing:
            _refuse(fleet, found, missing)
    return found


def prepare_state(fleet: Fleet) -> list[str]:
    """check_state, then make the admin password and CA the state directory lacks, for a new fleet
    only: nothing of it anywhere, and every host answered (StateMissing otherwise). What was made
    (logged)."""
    found = check_state(fleet)
    if found.evidence():
        return []
    if found.unreachable and layout.missing_fleet_secrets(fleet.paths):
        _refuse(fleet, found, layout.missing_fleet_secrets(fleet.paths))
    made = layout.make_fleet_secrets(fleet.paths)
    for what in made:  # the server's log; the commands print it themselves
        log.info("new fleet %r: made %s", fleet.config.fleet, what)
    return made
