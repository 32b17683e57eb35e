import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pgcarve.control.rates import Snapshot

from pgcarve_api.deps import ReadAuth, ServiceDep
from pgcarve_api.schemas import TpsOut

router = APIRouter(prefix="/v1", tags=["throughput"], dependencies=[ReadAuth])


def snapshot_doc(snap: Snapshot) -> dict[str, object]:
    return {
        "aggregate_tps": round(snap.aggregate_tps, 3),
        "aggregate_qps": round(snap.aggregate_qps, 3),
        "window_s": round(snap.window_s, 3),
        "at": snap.at,
        "xacts_total": snap.xacts_total,
        "statements_total": snap.statements_total,
        "instances": {
            name: {"tps": round(r.tps, 3), "qps": None if r.qps is None else round(r.qps, 3),
                   "replay_lag_bytes": r.replay_lag_bytes, "sampled_at": r.sampled_at}
            for name, r in sorted(snap.instances.items())
        },
    }


@router.get("/tps", response_model=TpsOut)
async def get_tps(service: ServiceDep) -> dict[str, object]:
    """Aggregate and per-instance TPS/QPS from the last poll (commit+rollback and statement rates)."""
    # async: runs on the event loop with the collector, so the tracker is never read mid-update.
    return snapshot_doc(service.latest())


@router.get("/tps/history", response_model=list[TpsOut])
async def get_tps_history(service: ServiceDep, seconds: float = Query(300, gt=0, le=3600)) -> list[dict[str, object]]:
    """The 1-second series over the last `seconds` (oldest first, up to one hour kept)."""
    return [snapshot_doc(s) for s in service.tracker.history(seconds)]


@router.get("/events")
async def events(request: Request, service: ServiceDep) -> StreamingResponse:
    """Server-sent events: the /v1/tps document once a second, plus instance count and operations."""

    async def stream() -> AsyncIterator[str]:
        last_at = None
        while not await request.is_disconnected():
            snap = service.latest()
            if snap.at != last_at:
                last_at = snap.at
                doc = snapshot_doc(snap)
                doc["instance_count"] = len(service.view.instances)
                doc["operations"] = [
                    {"id": op.id, "status": op.status, "target": op.target, "progress": op.progress,
                     "message": op.message} for op in service.operations.active()
                ]
                yield f"event: tps\ndata: {json.dumps(doc)}\n\n"
            await asyncio.sleep(0.5)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
