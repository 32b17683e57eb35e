"""What a repair did, and what the manager may do to whose guest.

A repair (control/recovery.py) returns its steps as typed RepairSteps, never as prose to be
searched; the supervisor (control/supervisor.py) names an incident's action after the most
decisive one. `manager_may` is the one rule for guests someone else created (Terraform's): the
manager may do to them only what changes nothing their owner's next plan would see.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from pgcarve.control.fleet import Instance
from pgcarve.errors import PgcarveError


class Action(enum.StrEnum):
    """What a repair step did to a guest."""

    RESTART = "restart"  # started again from its own disk
    REBUILD = "rebuild"  # removed and cloned again from the primary
    FAILOVER = "failover"  # a standby promoted in the primary's place
    REJOIN = "rejoin"  # a former primary rewound into a standby of the new one (its disk kept)
    FOLLOW = "follow"  # a running standby pointed at the current primary again
    REMOVE = "remove"  # a member replaced while its host was lost, removed once the replacement streams
    NONE = "none"  # nothing done; for a step left to the guest's owner, the message says what to do


# What the manager may do to a guest it did not create (Terraform's): what changes nothing that
# Terraform owns. Starting a domain again, promoting a standby or rewinding a former primary
# changes the guest's <metadata> (the provider never reads it back) and rewrites its seed volume
# in place (same key); Terraform's next plan shows no change. Removing a guest and creating
# another (REBUILD, and so building a missing standby) would make resources Terraform did not
# create, which its next apply would fight.
_ON_ANYONES_GUESTS = frozenset({Action.RESTART, Action.FAILOVER, Action.REJOIN, Action.FOLLOW})


def manager_may(action: Action, created_by: str) -> bool:
    """May a repair do `action` to a guest created by `created_by` ("manager" or "terraform")?
    Anything to the manager's own guests; to anyone else's, only what leaves their resources as
    they were made."""
    return created_by == "manager" or action in _ON_ANYONES_GUESTS


def instance_creator(inst: Instance) -> str:
    """Who built the instance: "manager", unless one of its guests was created by someone else
    (Terraform), whose configuration then holds the instance's guests, missing ones too."""
    return next((g.info.metadata.created_by for g in inst.guests if g.info.metadata.created_by != "manager"),
                "manager")


def left_to_owner(what: str, hosts: Iterable[str], damaged: bool = False) -> str:
    """The sentence for an operator when a repair needs a guest built that Terraform owns: `what`
    is wrong, and where `terraform apply` puts it right (`damaged`: the guest's disk may be)."""
    named = sorted(set(hosts))
    text = (f"{what}: pgcarve does not rebuild or create Terraform's guests; run `terraform apply` for "
            f"host{'s' if len(named) > 1 else ''} {', '.join(named)}")
    if damaged:
        text += " (add -replace for its domain, disk and seed if its disk is damaged)"
    return text


@dataclass(frozen=True)
class RepairStep:
    """One thing a repair did: to which guest (its name before the repair), and in words."""

    guest: str
    action: Action
    message: str


class RepairIncomplete(PgcarveError):
    """A repair that failed after doing something (a failover, say): what, and why it stopped."""

    def __init__(self, cause: PgcarveError, steps: tuple[RepairStep, ...]):
        super().__init__(str(cause))
        self.steps = steps


@dataclass(frozen=True)
class RepairResult:
    steps: tuple[RepairStep, ...] = ()
    # Faults the manager may not repair (manager_may), each with what an operator should do.
    left: tuple[RepairStep, ...] = ()

    def for_guest(self, guest: str) -> list[RepairStep]:
        return [step for step in self.steps if step.guest == guest]

    def left_for(self, guest: str) -> list[RepairStep]:
        return [step for step in self.left if step.guest == guest]

    def repaired(self, guest: str) -> bool:
        return any(step.guest == guest for step in self.steps)


def decisive(steps: list[RepairStep]) -> Action:
    """The most decisive thing done names a repair's action."""
    actions = {step.action for step in steps}
    return next((a for a in (Action.FAILOVER, Action.REJOIN, Action.REBUILD, Action.RESTART, Action.REMOVE,
                             Action.FOLLOW)
                 if a in actions), Action.NONE)
