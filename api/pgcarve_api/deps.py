"""Dependencies shared by the routes: the manager service, settings, and the token checks."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from pgcarve.control.service import ManagerService

from pgcarve_api.listener import Listener, is_loopback_address
from pgcarve_api.security import token_matches
from pgcarve_api.settings import Settings, get_settings

SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_service(request: Request) -> ManagerService:
    service: ManagerService = request.app.state.service
    return service


ServiceDep = Annotated[ManagerService, Depends(get_service)]


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def require_token(request: Request) -> None:
    """Every mutation needs `Authorization: Bearer <token>`."""
    if not token_matches(_bearer(request), request.app.state.token):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong API token: send 'Authorization: Bearer <token>' "
            "(PGCARVE_TOKEN, or the api-token file in the state directory)",
            headers={"WWW-Authenticate": "Bearer"},
        )


def on_loopback(request: Request) -> bool:
    """Whether the server listens on loopback only, decided from the socket it bound (`serve`
    passes it), never from the configured bind string: bound to 0.0.0.0 it is off loopback even
    for a request that arrived over 127.0.0.1. An app run without that (tests, another ASGI
    server) uses the address the request arrived on, ASGI's `server`."""
    listener: Listener | None = request.app.state.listener
    if listener is not None:
        return listener.loopback
    server = request.scope.get("server")
    return server is not None and is_loopback_address(str(server[0]))


def require_read_access(request: Request) -> None:
    """Reads are open on loopback; bound elsewhere, they need the token too."""
    if not on_loopback(request):
        require_token(request)


def require_leader(request: Request) -> None:
    """Among several managers of a fleet, only the leader changes anything: a standby answers every
    mutation with 503, naming the leader's URL (also in the X-Pgcarve-Leader header)."""
    service: ManagerService = request.app.state.service
    leadership = service.leadership
    if leadership is None or leadership.leads():
        return
    if leadership.holds_lease():
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                            detail="this manager has just become the leader and is taking over (finishing what the "
                                   "previous leader left, resuming its operations); try again in a few seconds")
    leader = leadership.read_leader()
    if leader is not None and leadership.is_me(leader):
        leader = None
    where = (f"the leader is {leader.describe()}; send changes there" if leader is not None
             else "no manager holds the fleet's lease right now (one takes over within seconds); try again")
    raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                        detail=f"this manager is a standby and changes nothing: {where}",
                        headers={"X-Pgcarve-Leader": leader.url} if leader is not None and leader.url else None)


def require_mutation(request: Request) -> None:
    """The token first (a caller without it learns nothing about the leader), then leadership."""
    require_token(request)
    require_leader(request)


MutationAuth = Depends(require_mutation)
ReadAuth = Depends(require_read_access)
