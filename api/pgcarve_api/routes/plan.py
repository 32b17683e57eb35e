from fastapi import APIRouter, Query

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.schemas import HostPlanOut

router = APIRouter(prefix="/v1", tags=["plan"], dependencies=[ReadAuth])


@router.get("/plan", response_model=list[HostPlanOut])
def get_plan(service: ServiceDep, instances: int = Query(ge=0, le=100000)) -> list[dict[str, object]]:
    """Which host CPUs, NUMA node and emulator CPUs N instances would get on every host."""
    return service.plan(instances)
