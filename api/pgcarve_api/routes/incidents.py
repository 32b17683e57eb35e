from fastapi import APIRouter

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.schemas import IncidentOut

router = APIRouter(prefix="/v1", tags=["incidents"], dependencies=[ReadAuth])


@router.get("/incidents", response_model=list[IncidentOut])
def list_incidents(service: ServiceDep) -> list[dict[str, object]]:
    """Faults the manager noticed (guests stopped or paused without being asked) and what it did."""
    return [incident.public() for incident in service.incidents()]
