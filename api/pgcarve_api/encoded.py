"""Responses encoded once and served many times.

A list route whose documents the service keeps between changes (``ManagerService.instance_docs``
returns the same list object until a view refresh, a collector round or an incident) need not
validate and encode them again for every request: at hundreds of instances that work, and
the garbage it leaves for Python's collector, was most of a request's time and all of its tail.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import Response
from pydantic import TypeAdapter


class EncodedOnce:
    """The JSON of the last documents seen, validated against the route's model, kept until the
    documents change (compared by identity: the producer promises a new object for new content)."""

    def __init__(self, model: Any):
        self._adapter: TypeAdapter[Any] = TypeAdapter(model)
        self._last: tuple[object, bytes] | None = None
        self._lock = threading.Lock()

    def response(self, docs: object) -> Response:
        last = self._last
        if last is None or last[0] is not docs:
            with self._lock:
                last = self._last
                if last is None or last[0] is not docs:
                    body = self._adapter.dump_json(self._adapter.validate_python(docs))
                    last = self._last = (docs, body)
        return Response(content=last[1], media_type="application/json")
