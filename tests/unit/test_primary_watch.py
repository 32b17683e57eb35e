"""The primary watch and the instance locks: while an operation holds an instance only the
lease is renewed, except while a repair mends standbys only (the synchronous set is kept then)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pgcarve.control.locks import InstanceLocks
from pgcarve.control.primary_watch import PrimaryWatch
from pgcarve.control.sync import KeepResult


class RecordingKeeper:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def keep(self, inst: Any) -> KeepResult:
        self.calls.append(f"keep {inst.name}")
        return KeepResult(changed=None, confirming=True)

    def renew_lease(self, inst: Any) -> None:
        self.calls.append(f"lease {inst.name}")


def watch_over_one_instance(roles_mismatch: str | None = None) -> tuple[PrimaryWatch, InstanceLocks, RecordingKeeper]:
    locks = InstanceLocks()
    fleet: Any = SimpleNamespace(
        locks=locks, sync_records=None,
        config=SimpleNamespace(replication=SimpleNamespace(standbys=2),
                               recovery=SimpleNamespace(sync_switch_after_s=3.0)))
    inst: Any = SimpleNamespace(index=1, name="pgc-01", primary=object(), roles_mismatch=roles_mismatch)
    watch = PrimaryWatch(fleet, lambda: [inst])
    keeper = RecordingKeeper()
    watch.keeper = keeper  # type: ignore[assignment]
    return watch, locks, keeper


def test_the_sync_set_is_kept_while_nobody_holds_the_instance() -> None:
    watch, _locks, keeper = watch_over_one_instance()
    watch.pass_once()
    assert keeper.calls == ["keep pgc-01"]


def test_only_the_lease_while_an_operation_holds_the_instance() -> None:
    watch, locks, keeper = watch_over_one_instance()
    with locks.exclusive(1, "scaling"):
        watch.pass_once()
    assert keeper.calls == ["lease pgc-01"]


def test_the_sync_set_is_kept_while_a_repair_mends_standbys_only() -> None:
    watch, locks, keeper = watch_over_one_instance()
    with locks.exclusive(1, "recovering from a fault"):
        with locks.welcome_keeper(1):
            watch.pass_once()
        watch.pass_once()  # the repair goes on to something else: the lease only again
    assert keeper.calls == ["keep pgc-01", "lease pgc-01"]


def test_an_instance_made_under_the_other_decider_of_roles_is_not_touched() -> None:
    """Neither its synchronous set nor the manager's lease on it (control/roles_guard.py)."""
    watch, _locks, keeper = watch_over_one_instance(roles_mismatch="pgc-01 was made under Patroni's roles ...")
    watch.pass_once()
    assert keeper.calls == []
