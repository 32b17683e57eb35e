"""Refuse requests whose Host header names another server: the DNS-rebinding defence.

A web page from evil.test can point its own name at 127.0.0.1 and then read the API from the
victim's browser as "same origin"; its requests still say `Host: evil.test`. So every request
must name one of the names the server was started for (listener.server_names), or it gets 421
Misdirected Request with a detail that says which names are accepted. Starlette's
TrustedHostMiddleware does the same check, but answers with a bare "Invalid host header".
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pgcarve_api.listener import ServerNames


def host_of(header: str) -> str | None:
    """The host part of a Host header value ("name", "name:port", "[v6]", "[v6]:port"), without
    brackets; None if the value is malformed (e.g. a bare IPv6 address, or a non-numeric port)."""
    if header.startswith("["):
        host, sep, rest = header[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return host or None
    host, sep, port = header.partition(":")
    if sep and not port.isdigit():
        return None
    return host or None


class HostHeaderCheck:
    """ASGI middleware: 421 unless the Host header names one of `names`."""

    def __init__(self, app: ASGIApp, names: ServerNames):
        self.app = app
        self.names = names

    def _detail(self, presented: str | None) -> str:
        accepted = ", ".join(self.names.all())
        what = f"Host {presented[:100]!r}" if presented is not None else "no Host header"
        return (f"this pgcarve API answers only to the names it was started for ({accepted}); the request "
                f"has {what}. Use one of those names, or start the server with the name added to "
                "PGCARVE_ALLOWED_HOSTS (comma-separated)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(b"host")
        presented = raw.decode("latin-1") if raw is not None else None
        host = host_of(presented) if presented is not None else None
        if host is not None and self.names.accepts(host):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = JSONResponse({"detail": self._detail(presented)}, status_code=421)
        await response(scope, receive, send)
