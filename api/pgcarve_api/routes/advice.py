"""`/v1/advice`: does carving help this host? Accepted as an operation (202), checked at once
(409/400/404 before anything is created); finished runs kept with their report."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, status
from fastapi.responses import HTMLResponse
from pgcarve.advice.plan import plan_advice

from pgcarve_api.advice_runs import KIND, AdviceStore, request_of
from pgcarve_api.deps import MutationAuth, ReadAuth, ServiceDep
from pgcarve_api.schemas import AdviceAccepted, AdviceIn

router = APIRouter(prefix="/v1", tags=["advice"])


def _store(request: Request) -> AdviceStore:
    store: AdviceStore = request.app.state.advice
    return store


@router.post("/advice", response_model=AdviceAccepted, status_code=status.HTTP_202_ACCEPTED,
             dependencies=[MutationAuth])
def advise(body: AdviceIn, service: ServiceDep) -> AdviceAccepted:
    """Measure whether carving the host helps (long: see the plan's estimate_s); progress in
    /v1/operations/{operation}, the result in /v1/advice/{operation}."""
    params = body.model_dump()
    plan = plan_advice(service.fleet, request_of(params))
    op = service.operations.submit(KIND, plan.largest, params)
    return AdviceAccepted(operation=op.id, status=op.status, plan=plan.to_dict())


@router.get("/advice", dependencies=[ReadAuth])
def list_advice(request: Request) -> list[dict[str, Any]]:
    """Finished advice runs, newest first."""
    return _store(request).summaries()


@router.get("/advice/{run_id}", dependencies=[ReadAuth])
def get_advice(run_id: str, request: Request) -> dict[str, Any]:
    return _store(request).get(run_id)


@router.get("/advice/{run_id}/report", response_class=HTMLResponse, dependencies=[ReadAuth])
def advice_report(run_id: str, request: Request) -> HTMLResponse:
    return HTMLResponse(_store(request).page(run_id))
