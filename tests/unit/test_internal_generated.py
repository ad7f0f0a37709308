"""The committed gRPC code in cursus/internal/v1/ is what ``make proto`` generates from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
GENERATED_DIR = ROOT / "cursus" / "internal" / "v1"


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools is not installed (pip install -e '.[dev]')")
    protos = sorted(str(p.relative_to(ROOT)) for p in (PROTO_DIR / "cursus" / "internal" / "v1").glob("*.proto"))
    assert protos, "no .proto files under proto/cursus/internal/v1"
    # The same command as `make proto`, writing into a scratch directory.
    result = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *protos],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    fresh_dir = tmp_path / "cursus" / "internal" / "v1"
    fresh = {p.name: p.read_bytes() for p in fresh_dir.iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in GENERATED_DIR.iterdir()
                 if p.is_file() and p.name != "__init__.py" and p.suffix in (".py", ".pyi")}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run `make proto` and commit"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run `make proto` and commit the result"
