from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.raftsupport import RaftPki, make_test_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> RaftPki:
    return make_test_pki(Path(tmp_path_factory.mktemp("raft-pki")))
