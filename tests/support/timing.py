"""A pytest plugin that records when each test module starts and ends, with the machine's CPU
counters at those moments, for the table `make test` prints at its end (tests/lanes.py).

Active only when PGCARVE_TEST_TIMES names a file; each line of it is one JSON event. A module's
time includes the set-up of the fixtures its first test needs (the shared sandbox's boot counts
in the first module that uses it) and the teardown that runs after its last test.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.support.cpu import cpu_counters


class ModuleClock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.module: str | None = None

    def emit(self, event: str, module: str) -> None:
        line = {"event": event, "module": module, "at": time.time(), "cpu": cpu_counters()}
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        module = item.nodeid.split("::", 1)[0]
        if module != self.module:
            if self.module is not None:
                self.emit("end", self.module)
            self.module = module
            self.emit("start", module)

    def pytest_sessionfinish(self) -> None:
        if self.module is not None:
            self.emit("end", self.module)
            self.module = None


def pytest_configure(config: pytest.Config) -> None:
    target = os.environ.get("PGCARVE_TEST_TIMES")
    if target:
        config.pluginmanager.register(ModuleClock(Path(target)), "pgcarve-module-clock")
