from fastapi import APIRouter
from pgcarve.postgres.statistics import WAIT_MEANING

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.schemas import WaitsOut

router = APIRouter(prefix="/v1", tags=["instances"], dependencies=[ReadAuth])


@router.get("/instances/{name}/waits", response_model=WaitsOut)
async def instance_waits(name: str, service: ServiceDep) -> dict[str, object]:
    """What the instance's client sessions waited on over the last window: each category's share of
    the sessions seen in pg_stat_activity samples of its primary (about 5 a second by default)."""
    # async: read on the event loop, where the sampler adds its samples.
    found = service.instance_waits(name)
    return {"instance": found.instance, "window_s": found.window_s, "samples": found.samples,
            "sessions": found.sessions, "shares": {k: round(v, 4) for k, v in found.shares.items()},
            "meaning": dict(WAIT_MEANING), "dominant": found.dominant, "summary": found.summary(),
            "error": found.error}
