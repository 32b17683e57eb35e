from fastapi import APIRouter, HTTPException, status

from pgcarve_api.deps import MutationAuth, ReadAuth, ServiceDep
from pgcarve_api.schemas import OperationOut, ScaleAccepted, ScaleIn

router = APIRouter(prefix="/v1", tags=["scale"])


@router.put("/scale", response_model=ScaleAccepted, status_code=status.HTTP_202_ACCEPTED,
            dependencies=[MutationAuth])
def scale(body: ScaleIn, service: ServiceDep) -> ScaleAccepted:
    """Ask for N instances. Validated at once (409 above capacity); the work runs as an operation."""
    op = service.request_scale(body.instances)
    return ScaleAccepted(operation=op.id, status=op.status, target=op.target)


@router.get("/operations", response_model=list[OperationOut], dependencies=[ReadAuth])
def list_operations(service: ServiceDep) -> list[dict[str, object]]:
    return [op.public() for op in service.operations.all()]


@router.get("/operations/{op_id}", response_model=OperationOut, dependencies=[ReadAuth])
def get_operation(op_id: str, service: ServiceDep) -> dict[str, object]:
    op = service.operations.get(op_id)
    if op is None:
        raise HTTPException(status_code=404, detail=f"no operation {op_id!r}")
    return op.public()
