"""The instances' documents (GET /v1/instances), kept between changes.

Built from the service's view and kept until what they were built from changes (a refresh that
finds a change, a collector round, an incident): every read in between shares the same list
object, so the API encodes it once (pgcarve_api/encoded.py). After each refresh the refresher
builds again those that were read since the last build, so a request seldom pays for a build
(at a thousand instances one costs a few hundred milliseconds) and nobody builds for no reader.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Documents = list[dict[str, Any]]


class Listing:
    """Documents per variant (with or without retired instances), each kept with its key."""

    def __init__(self, key: Callable[[], tuple[object, ...]], build: Callable[[bool], Documents]):
        self._key, self._build = key, build
        self._kept: dict[bool, tuple[tuple[object, ...], Documents]] = {}
        self._read: set[bool] = set()  # variants read since their last build
        self._lock = threading.Lock()  # one build at a time: concurrent misses wait for it

    def get(self, include_retired: bool) -> Documents:
        """The documents, built again only if what they come from changed."""
        self._read.add(include_retired)
        return self._current(include_retired)

    def build_read(self) -> None:
        """Build again, if changed, the variants read since their last build (the refresher's)."""
        read, self._read = self._read, set()
        for include_retired in read:
            self._current(include_retired)

    def _current(self, include_retired: bool) -> Documents:
        key = self._key()  # before building: at worst the documents are newer than their key
        kept = self._kept.get(include_retired)
        if kept is not None and kept[0] == key:
            return kept[1]
        with self._lock:
            key = self._key()  # another thread may have built them meanwhile
            kept = self._kept.get(include_retired)
            if kept is not None and kept[0] == key:
                return kept[1]
            docs = self._build(include_retired)
            self._kept[include_retired] = (key, docs)
            return docs
