from fastapi import APIRouter, Response

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.encoded import EncodedOnce
from pgcarve_api.schemas import InstanceOut

router = APIRouter(prefix="/v1", tags=["instances"], dependencies=[ReadAuth])
_listing = EncodedOnce(list[InstanceOut])


@router.get("/instances", response_model=list[InstanceOut])
async def list_instances(service: ServiceDep) -> Response:
    """Every instance: its primary's pinned host CPUs, DSN and its standbys' replication state."""
    # async: on the event loop with the collector (no thread hop, no round read half-way); the
    # documents are built once per change and encoded once per change (pgcarve_api/encoded.py).
    return _listing.response(service.instance_docs())


@router.get("/instances/{name}", response_model=InstanceOut)
def get_instance(name: str, service: ServiceDep) -> dict[str, object]:
    return service.instance_doc(name)
