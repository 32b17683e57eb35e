"""Shared test configuration."""

import os
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--regenerate-output", action="store_true", default=False,
                     help="rewrite golden files under tests/data/ instead of comparing against them")


@pytest.fixture
def regenerate(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regenerate-output"))


def image_dir() -> Path:
    return Path(os.environ.get("PGCARVE_IMAGE_DIR", "/var/lib/pgcarve/image"))
