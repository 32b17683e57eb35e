"""A live pgcarve API for browser tests: the real app and ManagerService on libvirt's test driver
(tests/utils/live_api.py), with two instances and throughput fed once a second."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.live_api import LiveApi, serve_live_api


@pytest.fixture
def live_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    # No guest image on purpose: a scale-up is accepted, then fails fast with ImageMissing.
    monkeypatch.setenv("PGCARVE_IMAGE_DIR", str(tmp_path / "no-image"))
    monkeypatch.delenv("PGCARVE_HOSTS_FILE", raising=False)
    with serve_live_api(tmp_path / "state") as api:
        yield api
