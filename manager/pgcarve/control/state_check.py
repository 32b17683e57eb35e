"""A manager never makes the fleet's secrets anew over a running fleet.

The fleet's admin password and its CA exist only in the state directory. Made anew while guests
run, they lock the manager out of every guest (a password no guest knows, a CA no guest's
certificate chains to): it can no longer log in, clients no longer verify any guest, standbys can
no longer be rebuilt. So where the state directory lacks them but the fleet's guests exist, the
manager refuses to start and names what to restore.
"""

from __future__ import annotations

from pgcarve.control.fleet import Fleet
from pgcarve.errors import ConfigError
from pgcarve.guest.tls import check_private_file


def missing_state(fleet: Fleet) -> list[str]:
    """What of the state the fleet's guests depend on is not in the state directory."""
    missing = []
    if not fleet.paths.secrets_file.exists():
        missing.append(f"{fleet.paths.secrets_file} (the fleet's admin password)")
    for path, what in ((fleet.ca.key_file, "the fleet CA's key"), (fleet.ca.cert_file, "the fleet CA's certificate")):
        if not path.exists():
            missing.append(f"{path} ({what})")
    return missing


def check_secret_files(fleet: Fleet) -> None:
    """ConfigError if a file holding the fleet's or an instance's passwords can be read by group or
    others (they are written 0600 whatever the umask; a looser one was changed since, or copied)."""
    files = [fleet.paths.secrets_file, *sorted(fleet.paths.instance_secrets_dir.glob("*.json"))]
    for path in files:
        if path.exists():
            check_private_file(path, "the passwords file")


def check_state(fleet: Fleet) -> None:
    """ConfigError if a secrets file is readable by others, or if guests of the fleet exist while
    the state directory lacks what they depend on; nothing is made or changed. A fleet without
    guests may start from an empty directory."""
    check_secret_files(fleet)
    missing = missing_state(fleet)
    if not missing:
        return
    guests = sorted(g.name for g in fleet.guests())
    unreachable = sorted(fleet.unreachable_hosts())
    if unreachable and not guests:
        raise ConfigError(
            f"the state directory {fleet.paths.state_dir} lacks {'; '.join(missing)}, and hosts "
            f"{', '.join(unreachable)} do not answer, so whether guests of fleet {fleet.config.fleet!r} run there "
            "cannot be told; none are made until every host answers (or restore them from a backup)")
    if not guests:
        return
    shown = ", ".join(guests[:6]) + (f" and {len(guests) - 6} more" if len(guests) > 6 else "")
    raise ConfigError(
        f"fleet {fleet.config.fleet!r} has guests ({shown}) but the state directory {fleet.paths.state_dir} lacks "
        f"{'; '.join(missing)}. New ones would lock the manager out of every guest, so none are made: restore "
        f"them from a backup of {fleet.paths.state_dir}, or point PGCARVE_STATE_DIR at the directory that has them")
