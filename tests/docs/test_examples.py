"""Every ``sh``/``bash``/``shell`` and ``python`` example in README.md and docs/*.md runs as written.

The examples are extracted in document order and run against one real standalone broker on a free port,
each document's blocks in one scratch directory (a block may use a file an earlier block of the same page
wrote): shell blocks with ``bash -e -o pipefail`` (``cursusctl`` on ``PATH``, ``.venv`` linked to this
interpreter's environment, ``CURSUS_BROKER`` set), Python blocks with this interpreter. The docs' default
address ``127.0.0.1:9000`` (or ``localhost:9000``) stands for the test's broker and is replaced by its address;
nothing else in a block is changed.

A block that cannot run here (a cluster, Docker, a service that runs forever, files that are genuinely
external) says so right above its fence with ``<!-- example: skip REASON -->``; a skip without a reason
fails, and so does a block that exits non-zero or runs longer than its timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.brokerproc import BrokerProcess

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python", "py": "python"}
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_SKIP = re.compile(r"<!--\s*example:\s*skip\b\s*(.*?)\s*-->")
_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):9000\b")
TIMEOUT_S = 30

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Example:
    doc: Path
    line: int
    language: str
    code: str
    skip: str | None  # the reason, "" for a marker without one, None when the block runs

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def extract(path: Path) -> Iterator[Example]:
    """The runnable fenced blocks of ``path`` (indented fences included, their indent removed)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, language = match.group(1), match.group(2).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if language not in LANGUAGES:
            continue
        skip = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = _SKIP.search(lines[j]) if j >= 0 else None
        if marker is not None:
            skip = marker.group(1)
        yield Example(path, start + 1, LANGUAGES[language], "\n".join(body) + "\n", skip)


EXAMPLES = [example for doc in DOCS for example in extract(doc)]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("docs-broker") / "data").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """One scratch directory per document, with ``.venv`` pointing at this interpreter's environment."""
    return {}


def _workdir(workdirs: dict[Path, Path], tmp_path_factory: pytest.TempPathFactory, doc: Path) -> Path:
    if doc not in workdirs:
        path = tmp_path_factory.mktemp(doc.stem)
        (path / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
        workdirs[doc] = path
    return workdirs[doc]


def test_every_skip_marker_gives_a_reason() -> None:
    missing = [e.name for e in EXAMPLES if e.skip == ""]
    assert not missing, f"<!-- example: skip REASON --> without a reason at {missing}"


def test_examples_were_found() -> None:
    assert len([e for e in EXAMPLES if e.skip is None]) >= 10


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs_as_written(example: Example, broker: BrokerProcess, workdirs: dict[Path, Path],
                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    if example.skip is not None:
        pytest.skip(f"marked in the doc: {example.skip or 'no reason given'}")
    host, port = broker.address
    address = f"{host}:{port}"
    code = _ADDRESS.sub(address, example.code)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "CURSUS_BROKER": address, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    cwd = _workdir(workdirs, tmp_path_factory, example.doc)
    if example.language == "shell":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{example.name} ran longer than {TIMEOUT_S} s (mark it <!-- example: skip REASON --> if "
                    f"it is meant to run forever)\n--- stdout\n{_tail(exc.stdout)}\n--- stderr\n{_tail(exc.stderr)}")
    assert done.returncode == 0, (f"{example.name} exited {done.returncode}\n--- code\n{code}\n--- stdout\n"
                                  f"{_tail(done.stdout)}\n--- stderr\n{_tail(done.stderr)}")


def _tail(output: str | bytes | None, limit: int = 2000) -> str:
    text = output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
    return text if len(text) <= limit else f"...{text[-limit:]}"
