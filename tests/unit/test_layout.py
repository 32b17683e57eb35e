"""The layout's rules, checked on the source (docs/architecture.md explains them):

* only pgcarve.virt imports libvirt;
* every SQL statement pgcarve sends is written in pgcarve.postgres;
* lower layers never import upper ones, and nothing in the product imports the benchmark or
  the tests;
* no product module grows much over 400 lines.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = REPO / "manager" / "pgcarve"
API = REPO / "api" / "pgcarve_api"

# Which packages each one may import (besides itself and the shared leaves below).
LEAVES = {"pgcarve.errors", "pgcarve.naming", "pgcarve.addresses", "pgcarve.settings", "pgcarve.processes",
          "pgcarve.config", "pgcarve.failpoints", "pgcarve.filelock"}
ALLOWED = {
    "pgcarve.planning": set(),
    "pgcarve.virt": {"pgcarve.planning"},
    "pgcarve.postgres": set(),
    "pgcarve.guest": {"pgcarve.virt", "pgcarve.postgres", "pgcarve.planning"},
    "pgcarve.dcs": set(),
    "pgcarve.backup": set(),
    "pgcarve.patroni": {"pgcarve.dcs"},
    "pgcarve.statedir": {"pgcarve.guest"},
    "pgcarve.sandbox": {"pgcarve.virt", "pgcarve.guest", "pgcarve.dcs", "pgcarve.statedir"},
    "pgcarve.control": {"pgcarve.planning", "pgcarve.virt", "pgcarve.postgres", "pgcarve.guest", "pgcarve.sandbox",
                        "pgcarve.dcs", "pgcarve.patroni", "pgcarve.statedir", "pgcarve.backup"},
    "pgcarve.tfvars": {"pgcarve.control", "pgcarve.guest", "pgcarve.virt", "pgcarve.planning"},
    "pgcarve.advice": {"pgcarve.control", "pgcarve.planning", "pgcarve.postgres", "pgcarve.guest", "pgcarve.virt"},
    "pgcarve.cli": {"pgcarve.control", "pgcarve.planning", "pgcarve.postgres", "pgcarve.sandbox", "pgcarve.tfvars",
                    "pgcarve.guest", "pgcarve.virt", "pgcarve.advice", "pgcarve.dcs",
                    "pgcarve.patroni", "pgcarve.statedir"},
}
# A statement's opening words: what SQL sent to PostgreSQL starts with, and prose does not.
SQL = re.compile(r"^\s*(/\*.*?\*/\s*)?(select\s+\S+.*\s(from|as)\s|select\s+pg_|insert\s+into\s|update\s+\w+\s+set\s|"
                 r"delete\s+from\s|alter\s+(system|role|database|table)\s|create\s+(table|database|role|extension|"
                 r"index)\s|drop\s+(table|database|role)\s|with\s+\w+\s+as\s*\()", re.IGNORECASE | re.DOTALL)


def modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """pgcarve.control.fleet for manager/pgcarve/control/fleet.py."""
    parts = list(path.relative_to(PRODUCT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def package_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "pgcarve" else parts[0]


def test_only_the_virt_package_imports_libvirt() -> None:
    offenders = [str(p.relative_to(REPO)) for p in modules(PRODUCT) + modules(API)
                 if any(i == "libvirt" or i.startswith("libvirt.") for i in imports(p))
                 and not p.is_relative_to(PRODUCT / "virt")]
    assert offenders == []


def code_strings(path: Path) -> Iterator[tuple[int, str]]:
    """The string literals of a module that are not docstrings: (line, text)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_sql_is_written_only_in_the_postgres_package() -> None:
    """String literals that read as SQL statements, outside pgcarve.postgres (docstrings aside)."""
    offenders = [f"{path.relative_to(REPO)}:{line}: {text[:60]!r}"
                 for path in modules(PRODUCT) + modules(API) if not path.is_relative_to(PRODUCT / "postgres")
                 for line, text in code_strings(path) if SQL.match(text) and len(text.split()) >= 3]
    assert offenders == []


def test_only_the_backup_module_names_the_backup_tool() -> None:
    """No string the product uses outside backup/pgbackrest.py says `pgbackrest` (prose aside):
    a change of tool touches that module and the image only."""
    offenders = [f"{path.relative_to(REPO)}:{line}: {text[:60]!r}"
                 for path in modules(PRODUCT) + modules(API) if path != PRODUCT / "backup" / "pgbackrest.py"
                 for line, text in code_strings(path) if "pgbackrest" in text.lower()]
    assert offenders == []


def test_layers_import_only_what_is_below_them() -> None:
    offenders = []
    for path in modules(PRODUCT):
        own = package_of(module_name(path))
        if own not in ALLOWED:
            continue
        for name in imports(path):
            target = package_of(name)
            if not name.startswith("pgcarve") or target == own or name in LEAVES or target in LEAVES:
                continue
            if target not in ALLOWED[own]:
                offenders.append(f"{path.relative_to(REPO)} imports {name}")
    assert offenders == []


def test_the_product_never_imports_the_benchmark_the_tests_or_the_api() -> None:
    offenders = [f"{p.relative_to(REPO)} imports {i}" for p in modules(PRODUCT) for i in imports(p)
                 if package_of(i) in ("bench", "tests", "pgcarve_api")]
    assert offenders == []


@pytest.mark.parametrize("root", [PRODUCT, API], ids=["manager", "api"])
def test_no_module_is_much_over_400_lines(root: Path) -> None:
    long = {str(p.relative_to(REPO)): n for p in modules(root) if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}
