"""A manager's terms as the fleet's leader, among several (control/leadership.py decides them):
what it does when it becomes the leader and when it stops being one.

Taking over is what a restarted manager does at start, fenced at the new epoch: finish what the
previous leader left half-way (retirements, half-made guests), read the operation journal again
and resume what is unfinished, start the HA loop. Stepping down stops the HA loop; the operation
queue's worker stops by itself (it runs only while the lease is held) and every step in flight is
refused by the fence. Both run on a thread of their own, so the campaign loop keeps renewing.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from pgcarve.control.removal import discard_half_made
from pgcarve.control.retirement import finish_interrupted
from pgcarve.errors import NotLeader, PgcarveError

if TYPE_CHECKING:
    from pgcarve.control.service import ManagerService

log = logging.getLogger("pgcarve.control.terms")


class Terms:
    def __init__(self, service: ManagerService):
        self.service = service
        self._lock = threading.Lock()  # one takeover or step-down at a time, in order

    def begin(self, refresher: threading.Thread) -> None:
        """Start a manager that serves reads at once and acts only once elected."""
        service = self.service
        assert service.leadership is not None
        # Every host change and guest session is fenced; the queue runs and journals only while leading.
        service.fleet.fence = service.leadership.check
        service.operations.guard = service.leadership
        service.refresh()
        service.operations.start(resume=False)  # its worker waits for the lease
        refresher.start()
        # The first campaign on this thread: a fleet's only manager (or one restarted in place of a
        # dead leader) has taken over before the server listens, as a manager alone would have.
        service.leadership.on_elected, service.leadership.on_lost = self.take_over, self.lost
        service.leadership.campaign_once()
        service.leadership.on_elected = self.elected  # later takeovers on a thread of their own
        service.leadership.start()

    def elected(self, epoch: int) -> None:
        threading.Thread(target=self.take_over, args=(epoch,), name="pgcarve-takeover", daemon=True).start()

    def lost(self, epoch: int, reason: str) -> None:
        threading.Thread(target=self.step_down, args=(epoch, reason), name="pgcarve-stepdown", daemon=True).start()

    def take_over(self, epoch: int) -> None:
        service = self.service
        assert service.leadership is not None
        with self._lock:
            try:
                with service.leadership.acting():  # every step below is fenced at `epoch`
                    try:
                        for what in finish_interrupted(service.fleet):
                            log.warning("%s, left half-way by the previous leader", what)
                        for what in discard_half_made(service.fleet):
                            log.warning("removed %s, left by the previous leader in the middle of an operation", what)
                    except NotLeader:
                        raise
                    except PgcarveError as exc:
                        # A host that does not answer (lost: the very fault a new leader may have to
                        # repair) must not keep the HA loop from starting; what it holds is looked
                        # at again by the next leader's start.
                        log.error("could not check for half-made instances: %s; acting on the fleet anyway", exc)
                    service.refresh()
                    for op in service.operations.resume():
                        log.warning("resuming operation %s (%s %d) left unfinished by the previous leader",
                                    op.id, op.kind, op.target)
                    service.leadership.mark_ready(epoch)  # mutations accepted, operations run
                    if service.supervise:
                        if service.supervisor_started:  # a thread runs once: a new HA loop for a new term
                            service.supervisor = service.new_supervisor()
                        assert service.supervisor is not None
                        service.supervisor.start()
                        service.supervisor_started = True
                log.warning("took over at epoch %d: acting on the fleet", epoch)
            except PgcarveError as exc:
                log.error("taking over at epoch %d did not finish: %s", epoch, exc)

    def step_down(self, epoch: int, reason: str) -> None:
        service = self.service
        with self._lock:
            if service.supervisor is not None and service.supervisor_started:
                service.supervisor.stop()
            log.warning("stepped down (epoch %d: %s): serving reads; mutations answer 503", epoch, reason)
