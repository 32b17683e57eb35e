"""The FastAPI application: routers, error mapping, body limits and the service's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pgcarve.config import load_fleet_config
from pgcarve.control.leadership import Leadership
from pgcarve.control.service import ManagerService
from pgcarve.dcs.watch import EtcdWatch
from pgcarve.errors import (
    CapacityError,
    ConfigError,
    Conflict,
    DcsUnavailable,
    GuestCommandFailed,
    GuestNotReady,
    HostUnreachable,
    ImageMissing,
    LibvirtFailure,
    NotFound,
    NotLeader,
    PgcarveError,
    StateMissing,
)
from pgcarve.guest.tls import FleetCA
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pgcarve_api import advice_runs
from pgcarve_api.host_check import HostHeaderCheck
from pgcarve_api.listener import Listener, server_names
from pgcarve_api.metrics import build_registry
from pgcarve_api.routes import (
    advice,
    backups,
    ca,
    credentials,
    dashboard,
    health,
    hosts,
    incidents,
    instances,
    metrics,
    plan,
    scale,
    tps,
    waits,
)
from pgcarve_api.routes.dashboard import STATIC_DIR
from pgcarve_api.security import load_or_create_token
from pgcarve_api.settings import Settings, get_settings

log = logging.getLogger("pgcarve.api")

# pgcarve's error categories -> HTTP statuses, in this one place.
STATUS_FOR_ERROR: dict[type[PgcarveError], int] = {
    StateMissing: 503,  # the state directory lacks what the fleet depends on: the server's fault, not the request's
    ConfigError: 422,
    CapacityError: 409,
    Conflict: 409,
    NotFound: 404,
    ImageMissing: 503,
    HostUnreachable: 503,
    LibvirtFailure: 502,
    GuestCommandFailed: 502,
    GuestNotReady: 504,
    DcsUnavailable: 503,
    NotLeader: 503,  # a standby manager, or a leader that lost its lease mid-request
}


class BodyLimit:
    """Refuse request bodies over `limit` bytes with 413, before any route sees them."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(send)
            return
        # Read the whole body first (it is small by definition) so a chunked body over the
        # limit is refused here with 413, not half-parsed by a route.
        messages: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        response = JSONResponse({"detail": f"request body larger than {self.limit} bytes"}, status_code=413)
        await response({"type": "http"}, _empty_receive, send)


async def _empty_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def create_app(settings: Settings | None = None, service: ManagerService | None = None,
               listener: Listener | None = None) -> FastAPI:
    """The app; pass a service to share one (tests), else it is built from the settings.

    `listener` is the socket the server bound (`serve` passes it): reads are open without the
    token only if it is on loopback. ConfigError, before anything is served, for a short token,
    a token file or CA key others can read, or a bad PGCARVE_ALLOWED_HOSTS.
    """
    settings = settings or get_settings()
    paths = settings.paths

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = app.state.service is None
        if owned:
            config = load_fleet_config(settings.hosts_file_path())
            leadership = None
            if config.etcd is not None and config.etcd.manager_lease:
                leadership = Leadership(config.etcd, config.fleet, url=app.state.url)
            else:
                log.warning("no etcd.manager_lease in %s: this manager acts alone, with no standby; one manager per "
                            "state directory (an flock on %s/manager.lock)", settings.hosts_file_path(),
                            paths.state_dir)
            app.state.service = ManagerService(config, paths, refresh_s=settings.refresh_s, leadership=leadership,
                                               boot_timeout_s=settings.boot_timeout,
                                               collect=settings.collect,
                                               collect_interval_s=settings.collect_interval_s,
                                               supervise=settings.supervise,
                                               waits_hz=settings.waits_hz)
            advice_runs.register(app.state.service, app.state.advice)  # before start: resumed runs find it
            app.state.service.start()
        else:
            advice_runs.register(app.state.service, app.state.advice)
        etcd = app.state.service.config.etcd
        # Polled in the background only where collecting is on (PGCARVE_COLLECT), like the guests.
        etcd_watch = EtcdWatch(etcd) if etcd is not None and settings.collect else None
        if etcd_watch is not None:
            etcd_watch.start()
        app.state.registry = build_registry(app.state.service, etcd_watch, app.state.service.fleet.patroni)
        stop = asyncio.Event()
        collector = asyncio.create_task(app.state.service.run_collector(stop))
        try:
            yield
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(collector, 10)
            if etcd_watch is not None:
                etcd_watch.stop()
            if owned:
                app.state.service.stop()

    app = FastAPI(
        title="pgcarve",
        version="0.1.0",
        description="Carve a host into pinned guests, one synchronously replicated PostgreSQL primary each.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.advice = advice_runs.AdviceStore(paths.state_dir / "advice")
    app.state.listener = listener
    app.state.url = None  # where this server answers, once `serve` knows it (named in the leader key)
    app.state.server_names = server_names(settings.bind, listener, settings.extra_host_names)
    app.state.token, created = load_or_create_token(settings.token, paths.token_file)
    app.state.fleet_ca = FleetCA(paths.tls_dir)
    if app.state.fleet_ca.exists():  # made by `serve` for a new fleet (control/state_check.prepare_state)
        app.state.fleet_ca.load()  # a CA key others can read stops the start here
    if created:
        log.warning("generated a new API token in %s (mode 0600)", paths.token_file)

    @app.exception_handler(PgcarveError)
    async def pgcarve_error(_request: Request, exc: PgcarveError) -> JSONResponse:
        status = next((code for kind, code in STATUS_FOR_ERROR.items() if isinstance(exc, kind)), 500)
        return JSONResponse({"detail": str(exc)}, status_code=status)

    @app.middleware("http")
    async def no_sniff(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("X-Frame-Options", "DENY")
        return response

    for module in (health, hosts, instances, backups, waits, credentials, incidents, scale, plan, tps, metrics, ca,
                   advice, dashboard):
        app.include_router(module.router)
    STATIC_DIR.mkdir(exist_ok=True)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(HostHeaderCheck, names=app.state.server_names)  # added last: runs first
    return app
