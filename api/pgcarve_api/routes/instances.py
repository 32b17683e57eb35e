from typing import Literal

from fastapi import APIRouter, Query, Response, status

from pgcarve_api.deps import MutationAuth, ReadAuth, ServiceDep
from pgcarve_api.encoded import EncodedOnce
from pgcarve_api.schemas import FailoverIn, InstanceOut, OperationAccepted, PurgeOut, SwitchoverIn

router = APIRouter(prefix="/v1", tags=["instances"], dependencies=[ReadAuth])
_listing = EncodedOnce(list[InstanceOut])


@router.get("/instances", response_model=list[InstanceOut])
async def list_instances(service: ServiceDep,
                         include: Literal["retired"] | None = Query(None, description="`retired`: list retired "
                                                                    "instances too (state retired, disks kept)"),
                         ) -> Response:
    """Every instance: its primary's pinned host CPUs, DSN and its standbys' replication state."""
    # async: on the event loop with the collector (no thread hop, no round read half-way); the
    # documents are built once per change and encoded once per change (pgcarve_api/encoded.py).
    return _listing.response(service.instance_docs(include_retired=include == "retired"))


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
