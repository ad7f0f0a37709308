"""Every ``bench/bench_*.py`` module imports (``make bench`` runs them all; a stale import there only shows
up as an error line in a benchmark run). Importing runs no benchmark: each module's work is in ``run()``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(path.stem for path in _BENCH.glob("bench_*.py")))
def test_bench_module_imports_and_has_run(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "run", None)), f"bench.{name} has no run()"
