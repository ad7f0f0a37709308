"""The Wire v2 client listener never serves the spec's internal commands (issue 13, decision 1).

Broker-to-broker traffic has its own listener (gRPC over mutual TLS, ``cursus.internal``); a client
connection asking for an internal command gets ``internal_command_unauthorized``, even when it presents
the broker's real internal token, and nothing behind the command runs.
"""

from __future__ import annotations

import pytest

from cursus.wire import INTERNAL_COMMANDS, Command
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, error_of, ok_fields

pytestmark = pytest.mark.timeout(60)

TOKEN = "the-real-internal-token"
#: The replication-related ones the issue names, each with a plausible payload.
NAMED = {
    Command.REPLICATE_MESSAGE: {"topic": "t", "partition": "0", "offset": "0", "payload": "x"},
    Command.RAFT_APPLY: {"command": "CreateTopic", "payload": "{}"},
    Command.REPLICA_CATCHUP: {"topic": "t", "partition": "0", "offset": "0"},
    Command.REPLICATE_SNAPSHOT: {"topic": "t", "partition": "0"},
}


def test_every_internal_command_is_refused_on_the_client_listener(broker_factory) -> None:
    broker = broker_factory(settings={"internal_auth_token": TOKEN}).start()
    assert set(NAMED) <= INTERNAL_COMMANDS
    with connect(broker) as conn:
        create_topic(conn, "t")
        for command in sorted(INTERNAL_COMMANDS):
            for fields in (NAMED.get(command, {}), {**NAMED.get(command, {}), "token": TOKEN,
                                                    "internal_token": TOKEN}):
                err = error_of(conn.call(command, fields))
                assert err.code == "internal_command_unauthorized", (command.name, err)
                assert err.fields.get("command") == command.name
                assert TOKEN not in str(err.fields) and TOKEN not in err.message
        # The text form takes the same path.
        err = error_of(conn.command(f"REPLICATE_MESSAGE topic=t partition=0 token={TOKEN} message=x"))
        assert err.code == "internal_command_unauthorized"
        # Nothing was appended by any of them and the connection stays usable.
        offsets = ok_fields(conn.command("LIST_OFFSETS topic=t"))["offsets"]
        assert offsets == "P0:earliest=0:latest=0:leo=0:hwm=0", offsets
    assert TOKEN not in broker.output()
