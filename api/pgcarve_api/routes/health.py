from fastapi import APIRouter

from pgcarve_api.deps import ServiceDep
from pgcarve_api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(service: ServiceDep) -> Health:
    """Liveness: the server answers; and whether the HA loop watches every host yet."""
    supervisor = service.supervisor
    if supervisor is None:
        return Health(ha_loop="off")
    return Health(ha_loop="watching" if supervisor.ready() else "starting")
