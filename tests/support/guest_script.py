"""The image's guest scripts (images/rootfs/usr/local/sbin/) loaded as modules: pgcarve-guest-setup
for the tests of what it does with a seed, pgcarve-watchdog for its session to PostgreSQL."""

from __future__ import annotations

import importlib.util
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

import pytest

GUEST_SBIN = Path(__file__).resolve().parents[2] / "images" / "rootfs" / "usr" / "local" / "sbin"


def load_guest_script(name: str) -> ModuleType:
    """A fresh copy of the module of the image's script `name`."""
    loader = SourceFileLoader(name.replace("-", "_"), str(GUEST_SBIN / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_guest_setup() -> ModuleType:
    return load_guest_script("pgcarve-guest-setup")


@pytest.fixture
def guest_setup() -> ModuleType:
    """A fresh copy of the script's module (tests patch its paths)."""
    return load_guest_setup()
