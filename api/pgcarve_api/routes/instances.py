from typing import Literal

from fastapi import APIRouter, Query, Response, status

from pgcarve_api.deps import MutationAuth, ReadAuth, ServiceDep
from pgcarve_api.encoded import EncodedOnce
from pgcarve_api.schemas import FailoverIn, InstanceOut, OperationAccepted, PurgeOut, SwitchoverIn

router = APIRouter(prefix="/v1", tags=["instances"], dependencies=[ReadAuth])
# One encoding per `include` value: in a single slot, every alternate request evicted the other.
_listings = {include: EncodedOnce(list[InstanceOut]) for include in (False, True)}


@router.get("/instances", response_model=list[InstanceOut])
def list_instances(service: ServiceDep,
                   include: Literal["retired"] | None = Query(None, description="`retired`: list retired "
                                                              "instances too (state retired, disks kept)"),
                   ) -> Response:
    """Every instance: its primary's pinned host CPUs, DSN and its standbys' replication state."""
    # Not async: the documents are built again after every collector round (files read, locks
    # taken), which on the event loop would stall the collector and the wait sampler; FastAPI
    # runs this in its threadpool. Encoded once per build (pgcarve_api/encoded.py).
    retired = include == "retired"
    return _listings[retired].response(service.instance_docs(include_retired=retired))


@router.get("/instances/{name}", response_model=InstanceOut)
def get_instance(name: str, service: ServiceDep) -> dict[str, object]:
    return service.instance_doc(name)


@router.delete("/instances/{name}", response_model=PurgeOut, dependencies=[MutationAuth])
def purge(name: str, service: ServiceDep,
          confirm: str | None = Query(None, description="the instance's name again: deleting its data is for good"),
          ) -> dict[str, object]:
    """Delete a retired instance's disks (its database) for good. Refused for an instance that
    is not retired (scale down first), and without `confirm` repeating its name."""
    return service.purge(name, confirm)


@router.post("/instances/{name}/failover", response_model=OperationAccepted, status_code=status.HTTP_202_ACCEPTED,
             dependencies=[MutationAuth])
def failover(name: str, body: FailoverIn, service: ServiceDep) -> OperationAccepted:
    """Promote a standby by hand. Without `force`, only one proven to hold every acknowledged
    commit (as the HA loop would); with `force` and `to`, that standby, and the operation's result
    says what may be missing on it. Runs as an operation (GET /v1/operations/{id})."""
    op = service.request_failover(name, body.to, body.force)
    return OperationAccepted(operation=op.id, status=op.status, kind=op.kind)


@router.post("/instances/{name}/switchover", response_model=OperationAccepted,
             status_code=status.HTTP_202_ACCEPTED, dependencies=[MutationAuth])
def switchover(name: str, body: SwitchoverIn, service: ServiceDep) -> OperationAccepted:
    """A planned role swap with nothing lost: `to` (default: the synchronous standby) replays
    everything, then takes over; the old primary rejoins as a standby. The operation's result
    has the write pause it caused."""
    op = service.request_switchover(name, body.to)
    return OperationAccepted(operation=op.id, status=op.status, kind=op.kind)
