from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pgcarve_api.deps import ReadAuth

router = APIRouter(tags=["metrics"], dependencies=[ReadAuth])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
