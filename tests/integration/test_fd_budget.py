"""CREATE is refused before commit when its partitions would not fit the open-file limit (break-it finding:
a topic committed but not openable made every restart fail with EMFILE)."""

from __future__ import annotations

import shutil

import pytest

from tests.brokerproc import BrokerProcess
from tests.integration.conftest import connect
from tests.integration.helpers import error_of, ok_fields

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")

NOFILE = 600


class LimitedBroker(BrokerProcess):
    """A broker whose hard open-file limit is NOFILE (it can raise its soft limit no further)."""

    def command(self) -> list[str]:
        return ["prlimit", f"--nofile={NOFILE}:{NOFILE}", *super().command()]


def test_create_beyond_the_fd_budget_is_refused_before_commit_and_restart_still_works(tmp_path):
    broker = LimitedBroker(tmp_path / "data", settings={"max_client_connections": 50}).start()
    try:
        with connect(broker) as conn:
            assert ok_fields(conn.command("CREATE topic=fits partitions=20"))["partitions"] == "20"
            err = error_of(conn.command("CREATE topic=huge partitions=400"))
            assert err.code == "resource_exhausted" and err.retryable
            assert "ulimit" in err.fields.get("reason", "")
            grow = error_of(conn.command("CREATE topic=fits partitions=400"))  # growth counts only new ones
            assert grow.code == "resource_exhausted"
            assert ok_fields(conn.command("LIST"))["topics"] == "fits"
        broker.kill()
        broker.start()  # nothing half-created: the restart opens what was committed
        with connect(broker) as conn:
            assert ok_fields(conn.command("LIST"))["topics"] == "fits"
            assert ok_fields(conn.command("METADATA topic=fits"))["partitions"] == "20"
    finally:
        broker.kill()
