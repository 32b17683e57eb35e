"""A switchover or failover asked for by an operator: by whoever decides roles in this fleet.
Under Patroni (replication.roles: patroni) it is asked of Patroni (control/patroni_roles_by_hand.py);
otherwise the manager's own mechanics run it (control/switchover.py, control/failover.py)."""

from __future__ import annotations

from pgcarve.control import patroni_roles_by_hand as patroni_hand
from pgcarve.control.failover import Failover
from pgcarve.control.fleet import Fleet, Instance, Progress
from pgcarve.control.patroni_roles_by_hand import RoleChange
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.roles_guard import refuse
from pgcarve.control.switchover import Switchover


def run_role_change(fleet: Fleet, provisioner: Provisioner, inst: Instance, kind: str, to: str | None,
                    forced: bool, progress: Progress) -> RoleChange:
    """Run a "switchover" or "failover" of `inst` to `to`; the operation's result and message.
    RolesMismatch, nothing done, for an instance made under the other decider of roles."""
    refuse(inst.roles_mismatch)
    if fleet.patroni is not None:
        if kind == "switchover":
            return patroni_hand.switchover(fleet, inst, to, progress)
        return patroni_hand.failover(fleet, inst, to, forced, progress)
    if kind == "switchover":
        done = Switchover(fleet, provisioner).run(inst, to, progress)
        return RoleChange({"new_primary": done.new_primary, "host": done.host, "write_pause_s": done.write_pause_s},
                          done.message)
    outcome = Failover(fleet, provisioner).run(inst, to, forced=forced, progress=progress)
    return RoleChange({"new_primary": outcome.new_primary, "host": outcome.host, "proven": outcome.proven,
                       "may_be_missing": outcome.may_be_missing, "reason": outcome.reason}, outcome.message)
