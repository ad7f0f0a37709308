"""cursus/coordinator/ never imports cursus/broker/ (not even under TYPE_CHECKING): the broker passes what the
coordinator needs (cursus.coordinator.ports), so the same coordinator can run over another group log."""

from __future__ import annotations

import ast
from pathlib import Path

import cursus.coordinator

PACKAGE = Path(cursus.coordinator.__file__).parent


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved against ``cursus.coordinator``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: ``from .. import broker`` inside cursus.coordinator
                base = ["cursus", "coordinator"][: max(0, 3 - node.level)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names]
    return found


def test_the_coordinator_does_not_import_the_broker():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 5
    offenders = {f.name: m for f in files for m in imported_modules(f)
                 if m == "cursus.broker" or m.startswith("cursus.broker.")}
    assert offenders == {}


def test_the_check_sees_broker_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cursus.broker.core import Broker\n"
                      "from .. import broker\nimport cursus.broker.replica as r\n")
    assert {m for m in imported_modules(sample) if m.startswith("cursus.broker")} == \
        {"cursus.broker.core", "cursus.broker.core.Broker", "cursus.broker", "cursus.broker.replica"}
