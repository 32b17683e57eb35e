from fastapi import APIRouter
from pgcarve.control.leadership import describe_role

from pgcarve_api.deps import ServiceDep
from pgcarve_api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(service: ServiceDep) -> Health:
    """Liveness: the server answers; its role among the fleet's managers (leader or standby, and
    the leader's URL); and whether the HA loop watches every host yet."""
    leadership = describe_role(service.leadership)
    supervisor = service.supervisor
    if supervisor is None or leadership["role"] != "leader":
        ha_loop = "off"
    else:
        ha_loop = "watching" if supervisor.ready() else "starting"
    return Health(ha_loop=ha_loop, role=leadership["role"], leadership=leadership)
