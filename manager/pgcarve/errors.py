"""pgcarve's own exceptions.

Every error raised to a user is a PgcarveError whose message says what happened in operator
terms (what, where, the limit). libvirt and PostgreSQL errors are translated into these at the
boundary of the module that talks to them; the CLI and the API map the categories to exit codes
and HTTP statuses in one place each.
"""


class PgcarveError(Exception):
    """Base class: the message is meant for an operator."""


class ConfigError(PgcarveError):
    """A configuration file or value is invalid."""


class StateMissing(ConfigError):
    """Something the fleet's guests depend on (its admin password, its CA, an instance's passwords) is
    not in the state directory; the message names the file and how to restore it."""


class CapacityError(PgcarveError):
    """A request needs more CPUs or memory than a host has free."""


class HostUnreachable(PgcarveError):
    """A libvirt host could not be reached at its URI."""


class LibvirtFailure(PgcarveError):
    """libvirt refused or failed an operation on a reachable host."""


class ImageMissing(PgcarveError):
    """The guest image has not been built."""


class NotFound(PgcarveError):
    """A named instance, host or operation does not exist."""


class Conflict(PgcarveError):
    """The request conflicts with work in progress (e.g. another scale operation)."""


class RolesMismatch(Conflict):
    """An instance was made under the other decider of roles than the hosts file's
    replication.roles (control/roles_guard.py): pgcarve does not act on it; the message says why
    and what to do."""


class FailoverRefused(PgcarveError):
    """No standby can be proven to hold every acknowledged commit: nothing was promoted."""


class GuestNotReady(PgcarveError):
    """A guest did not reach the expected state (booted, accepting SQL) in time."""


class GuestStuck(GuestNotReady):
    """A new guest's boot stopped at a stage it should have passed (control/boot_watch.py): the
    message names the stage, why, and the console's last lines."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class SandboxError(PgcarveError):
    """The local sandbox could not be started, used or stopped."""


class DcsUnavailable(PgcarveError):
    """The DCS (etcd) could not be reached, refused pgcarve's certificate, or answered with an error."""


class PatroniRefused(Conflict):
    """Patroni on a guest refused a command (a switchover, a failover, a change of its settings);
    the message carries its reason."""


class PatroniUnavailable(GuestNotReady):
    """Patroni's REST API on a guest could not be reached, refused pgcarve's credentials, or answered
    with something that is not Patroni's."""


class PatroniOutcomeUnknown(PatroniUnavailable):
    """Patroni took a switchover or failover request but stopped waiting for its result (it answers
    "status unknown"): the cluster's keys say what happened."""


class NotLeader(PgcarveError):
    """This manager does not hold the fleet's leadership lease (or no longer does): it may not act."""


class GuestCommandFailed(PgcarveError):
    """A command run inside a guest (through its agent) could not run, did not finish in time, or
    exited with an error; the message carries the command's own words."""
