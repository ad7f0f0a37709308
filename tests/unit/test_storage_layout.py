"""Log directory: lock, format version, clean-shutdown marker, paths; atomic writes."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from cursus.storage import LogDirLockedError, UnsupportedFormatError, atomic_write, open_log_dir
from tests.unit.test_storage_support import PYTHON, REPO_ROOT, subprocess_env

CHILD_OPEN = """
import sys
from pathlib import Path
from cursus.storage import LogDirLockedError, open_log_dir
try:
    open_log_dir(Path(sys.argv[1])).close()
except LogDirLockedError as error:
    print(error)
    sys.exit(3)
print("opened")
"""


def run_child_open(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-c", CHILD_OPEN, str(path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=30)


def test_second_process_cannot_open_a_locked_log_dir(tmp_path: Path) -> None:
    log_dir = open_log_dir(tmp_path / "data")
    try:
        child = run_child_open(tmp_path / "data")
        assert child.returncode == 3, child.stderr
        assert str(tmp_path / "data") in child.stdout and "another broker" in child.stdout
        with pytest.raises(LogDirLockedError):  # also within the same process (a second open fd)
            open_log_dir(tmp_path / "data")
    finally:
        log_dir.close()
    child = run_child_open(tmp_path / "data")
    assert child.returncode == 0 and "opened" in child.stdout


def test_format_file_is_created_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "data"
    open_log_dir(path).close()
    assert (path / ".cursus-format").read_bytes() == b"2\n"
    (path / ".cursus-format").write_text("3\n")
    with pytest.raises(UnsupportedFormatError, match="not supported"):
        open_log_dir(path)
    (path / ".cursus-format").write_bytes(b"\xff\xfe")
    with pytest.raises(UnsupportedFormatError):
        open_log_dir(path)
    (path / ".cursus-format").unlink()
    (path / ".cursus-format").mkdir()
    with pytest.raises(UnsupportedFormatError):
        open_log_dir(path)
    # the lock was released by every failed open
    (path / ".cursus-format").rmdir()
    open_log_dir(path).close()


def test_clean_shutdown_marker_is_consumed(tmp_path: Path) -> None:
    path = tmp_path / "data"
    with open_log_dir(path) as log_dir:
        assert not log_dir.clean_shutdown
        log_dir.mark_clean_shutdown()
    with open_log_dir(path) as log_dir:
        assert log_dir.clean_shutdown
        assert not (path / ".clean-shutdown").exists()
    with open_log_dir(path) as log_dir:
        assert not log_dir.clean_shutdown  # a crash now must look unclean


def test_partition_paths(tmp_path: Path) -> None:
    with open_log_dir(tmp_path / "data") as log_dir:
        assert log_dir.path == tmp_path / "data"
        assert log_dir.topics_dir == tmp_path / "data" / "topics" and log_dir.topics_dir.is_dir()
        assert log_dir.partition_dir("orders.v1", 3) == tmp_path / "data" / "topics" / "orders.v1" / "3"
        log_dir.partition_dir("a", 0).mkdir(parents=True)
        log_dir.partition_dir("a", 2).mkdir(parents=True)
        assert log_dir.list_partitions() == [("a", 0), ("a", 2)]
        with pytest.raises(AssertionError):
            log_dir.partition_dir("..", 0)


def test_atomic_write_replaces_content_with_mode(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write(target, b"one")
    atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_an_older_format_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "data"
    open_log_dir(path).close()
    (path / ".cursus-format").write_text("1\n")  # a log dir written before chunks carried leader epochs
    with pytest.raises(UnsupportedFormatError) as raised:
        open_log_dir(path)
    message = str(raised.value)
    assert "format '1'" in message and "reads format 2 only" in message
    assert "no migration" in message and "move" in message and str(path) in message
    assert (path / ".cursus-format").read_text() == "1\n"  # refused, not rewritten


def test_broker_refuses_an_older_log_dir_at_startup(tmp_path: Path) -> None:
    path = tmp_path / "data"
    open_log_dir(path).close()
    (path / ".cursus-format").write_text("1\n")
    child = subprocess.run([PYTHON, "-m", "cursus.cli.broker", "--log-dir", str(path), "--port", "0",
                            "--health-port", "0", "--metrics-port", "0"],
                           capture_output=True, text=True, timeout=60, env=subprocess_env(), cwd=REPO_ROOT)
    assert child.returncode != 0
    assert "storage format '1'" in child.stderr and "no migration" in child.stderr
