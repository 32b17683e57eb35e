from fastapi import APIRouter

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.schemas import InstanceOut

router = APIRouter(prefix="/v1", tags=["instances"], dependencies=[ReadAuth])


@router.get("/instances", response_model=list[InstanceOut])
def list_instances(service: ServiceDep) -> list[dict[str, object]]:
    """Every instance: its primary's pinned host CPUs, DSN and its standbys' replication state."""
    return service.instance_docs()


@router.get("/instances/{name}", response_model=InstanceOut)
def get_instance(name: str, service: ServiceDep) -> dict[str, object]:
    return service.instance_doc(name)
