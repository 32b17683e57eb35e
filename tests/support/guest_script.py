"""The image's setup script (images/rootfs/usr/local/sbin/pgcarve-guest-setup) loaded as a
module, for the tests of what it does with a seed."""

from __future__ import annotations

import importlib.util
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType

import pytest

GUEST_SETUP = Path(__file__).resolve().parents[2] / "images" / "rootfs" / "usr" / "local" / "sbin" / \
    "pgcarve-guest-setup"


def load_guest_setup() -> ModuleType:
    """A fresh copy of the script's module."""
    loader = SourceFileLoader("pgcarve_guest_setup", str(GUEST_SETUP))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture
def guest_setup() -> ModuleType:
    """A fresh copy of the script's module (tests patch its paths)."""
    return load_guest_setup()
