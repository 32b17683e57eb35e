from fastapi import APIRouter, status

from pgcarve_api.deps import MutationAuth, ReadAuth, ServiceDep
from pgcarve_api.schemas import FailoverIn, InstanceOut, OperationAccepted, SwitchoverIn

router = APIRouter(prefix="/v1", tags=["instances"], dependencies=[ReadAuth])


@router.get("/instances", response_model=list[InstanceOut])
def list_instances(service: ServiceDep) -> list[dict[str, object]]:
    """Every instance: its primary's pinned host CPUs, DSN and its standbys' replication state."""
    return service.instance_docs()


@router.get("/instances/{name}", response_model=InstanceOut)
def get_instance(name: str, service: ServiceDep) -> dict[str, object]:
    return service.instance_doc(name)


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
