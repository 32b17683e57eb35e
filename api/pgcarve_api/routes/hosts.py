from fastapi import APIRouter

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.schemas import HostOut

router = APIRouter(prefix="/v1", tags=["hosts"], dependencies=[ReadAuth])


@router.get("/hosts", response_model=list[HostOut])
def list_hosts(service: ServiceDep) -> list[dict[str, object]]:
    """Every configured libvirt host: topology, free CPUs and the guests it runs."""
    return service.hosts()
