from fastapi import APIRouter

from pgcarve_api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Liveness: the server answers."""
    return Health()
