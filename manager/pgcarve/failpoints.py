"""Named points where a test can make the manager die on purpose, as `kill -9` would.

PGCARVE_FAILPOINTS=name1,name2 (read once, at the first check) makes the process exit with
status 137 the first time it reaches each named point; a file per point in PGCARVE_FAILPOINT_DIR
(default: the working directory) remembers that it fired, so a restarted manager goes past it.
Unset (always, outside tests), a failpoint costs one set lookup. The fault tests use them to stop
the manager between the steps of a failover (tests/integration/test_host_failures.py).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


@functools.cache
def _armed() -> frozenset[str]:
    return frozenset(n.strip() for n in os.environ.get("PGCARVE_FAILPOINTS", "").split(",") if n.strip())


def failpoint(name: str) -> None:
    """Exit at once (status 137, no clean-up) if `name` is armed and has not fired yet."""
    if name not in _armed():
        return
    marker = Path(os.environ.get("PGCARVE_FAILPOINT_DIR", ".")) / f"failpoint-{name}.fired"
    if marker.exists():
        return
    marker.write_text(f"{os.getpid()}\n")
    log.error("failpoint %s: the manager stops here on purpose (a test asked for it)", name)
    logging.shutdown()
    os._exit(137)
