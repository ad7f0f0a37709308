"""Token authentication, permissions and topic ACLs against a real broker process (enable_sasl=true).

The permission matrix sends every command the broker serves as every permission set (and anonymously)
and checks the first refusal is the spec's: ``authentication_required command=``, then
``NOT_AUTHORIZED_FOR_OPERATION command= permission=``, else never an authorization error. ACL topics,
AUTH failures (delay, counted, connection usable, fail closed), inline credentials, acks=0 refusals, and
that no token ever shows in the broker's output or its /metrics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from cursus.broker.auth import COMMAND_PERMISSIONS, missing_permission
from cursus.broker.handlers import HANDLERS
from cursus.client import Admin
from cursus.client.connection import Connection, ConnectionOptions
from cursus.client.errors import AuthenticationError, AuthorizationError
from cursus.wire import INTERNAL_COMMANDS, Command, CommandPayload, Status, encode_crq2
from tests.brokerproc import BrokerProcess
from tests.integration.helpers import ack_of, create_topic, error_of, ok_fields, publish_batch, render

DELAY_MS = 60
#: principal -> (token, permissions); tokens are distinctive so a leak is easy to grep for.
USERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "root": ("tok-root-Q7f3", ("*",)),
    "admin": ("tok-admin-Lx92", ("admin",)),
    "reader": ("tok-reader-Hh41", ("topic.read",)),
    "writer": ("tok-writer-Pp05", ("topic.write",)),
    "grouper": ("tok-grouper-Ww77", ("group",)),
    "txn": ("tok-txn-Kk30", ("transaction",)),
    "consumer": ("tok-consumer-Mm18", ("topic.read", "group")),
    "ops": ("tok-ops-Zz64", ("admin", "topic.read", "topic.write", "group", "transaction")),
}
TOKENS = [token for token, _ in USERS.values()]


class _DebugBroker(BrokerProcess):
    """A broker logging at DEBUG, so the secret check covers every log line."""

    def command(self) -> list[str]:
        return [*super().command(), "--log-level", "DEBUG"]


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    users = ",".join(f"{p}:{token}:{'|'.join(perms)}" for p, (token, perms) in USERS.items())
    broker = _DebugBroker(Path(tmp_path_factory.mktemp("secure")) / "data",
                          settings={"enable_sasl": "true", "auth_failure_delay_ms": DELAY_MS, "exporter_port": 0},
                          env={"SASL_USERS": users}).start()
    with login(broker, "root") as conn:
        create_topic(conn, "open-t", 2)
        create_topic(conn, "acl-t", 1, auth_policy="acl", read_acl="consumer,ops", write_acl="writer")
        create_topic(conn, "star-t", 1, auth_policy="acl", read_acl="*", write_acl="*")
        create_topic(conn, "nowrite-t", 1, auth_policy="deny_write")
    yield broker
    broker.stop()


def login(broker: BrokerProcess, principal: str | None) -> Connection:
    host, port = broker.address
    if principal is None:
        return Connection(host, port)
    return Connection(host, port, principal=principal, token=USERS[principal][0])


def _fields_for(command: Command, principal: str) -> dict[str, str]:
    """Arguments that reach the handler when authorized (they may still be refused there for other
    reasons: that is fine, only authorization errors matter here). Nothing destructive to shared state."""
    base = {"topic": "open-t", "partition": "0", "group": "g-matrix", "member": "m-1", "generation": "0"}
    if command == Command.CREATE:
        return {"topic": f"made-by-{principal}", "partitions": "1"}
    if command == Command.DELETE:
        return {"topic": "never-existed", "if_exists": "true"}
    if command == Command.ALTER_TOPIC_CONFIG:
        return {"topic": "open-t", "min_in_sync_replicas": "default"}
    if command == Command.STREAM:
        return {**base, "partition": "x"}  # refused by validation once authorized: no open stream
    if command == Command.PUBLISH:
        return {"topic": "open-t", "producerId": "p-matrix", "message": "m", "partition": "0"}
    if command == Command.FIND_COORDINATOR:
        return {"group": "g-matrix"}
    if command == Command.ELECT_LEADER:
        return {"topic": "open-t", "partition": "0", "broker": "nobody"}
    if command == Command.AUTH:
        return {"principal": principal, "token": USERS[principal][0]} if principal != "anonymous" else {}
    return base


AUTH_CODES = {"authentication_required", "NOT_AUTHORIZED_FOR_OPERATION", "NOT_AUTHORIZED_FOR_TOPIC",
              "authentication_failed", "invalid_auth"}
SERVED = sorted(c for c in HANDLERS if c not in (Command.EXIT, Command.AUTH))  # AUTH: its own tests
#: Commands whose OK reply is two frames (facts B3.6).
TWO_FRAME_REPLIES = frozenset({Command.READ_STREAM, Command.BROWSE_MESSAGES})
UNSERVED = sorted(c for c in Command if c not in HANDLERS and c not in INTERNAL_COMMANDS and c != Command.NEGOTIATE)


@pytest.mark.parametrize("principal", ["anonymous", *USERS])
def test_permission_matrix(secure_broker, principal):
    granted = frozenset(USERS[principal][1]) if principal in USERS else frozenset()
    with login(secure_broker, None if principal == "anonymous" else principal) as conn:
        for command in SERVED:
            frame = conn.call(command, _fields_for(command, principal))
            if command in TWO_FRAME_REPLIES and frame.status == Status.OK:
                conn.read_frame()  # the CBV2 batch after the JSON envelope
            required = COMMAND_PERMISSIONS[command]
            where = f"{principal} {command.name}: {render(frame)}"
            if required and principal == "anonymous":
                err = error_of(frame)
                assert (err.code, err.fields) == ("authentication_required", {"command": command.name}), where
            elif required and missing_permission(granted, required) is not None:
                err = error_of(frame)
                assert err.code == "NOT_AUTHORIZED_FOR_OPERATION", where
                assert err.fields == {"command": command.name, "permission": missing_permission(granted, required)}
            elif frame.status == Status.ERROR:
                assert error_of(frame).code not in AUTH_CODES, where
        for command in UNSERVED:  # not built yet: nothing runs, whoever asks
            assert error_of(conn.call(command, {"topic": "open-t"})).code == "UNSUPPORTED_FEATURE"
        for command in sorted(INTERNAL_COMMANDS):  # the client listener never serves these
            assert error_of(conn.call(command, {})).code == "internal_command_unauthorized"
        assert ok_fields(conn.command("EXIT")) == {}


def test_internal_commands_refused_even_for_wildcard(secure_broker):
    with login(secure_broker, "root") as conn:
        err = error_of(conn.call(Command.REPLICATE_MESSAGE, {"internal_token": "guess"}))
        assert err.code == "internal_command_unauthorized"


def test_acl_topics(secure_broker):
    with login(secure_broker, "writer") as writer, login(secure_broker, "consumer") as consumer, \
            login(secure_broker, "root") as root, login(secure_broker, "reader") as reader:
        ack_of(publish_batch(writer, "acl-t", 0, [b"a1"]))  # CBV2: topic from the batch header
        ack_of(writer.command("PUBLISH topic=acl-t producerId=w message=a2 partition=0"))
        # '*' permissions do not bypass a topic's ACL
        for frame in (publish_batch(root, "acl-t", 0, [b"x"]),
                      root.command("PUBLISH topic=acl-t producerId=r message=x partition=0")):
            err = error_of(frame)
            assert (err.code, err.fields) == ("NOT_AUTHORIZED_FOR_TOPIC", {"topic": "acl-t", "operation": "write"})
        err = error_of(root.command("CONSUME topic=acl-t partition=0 offset=0"))
        assert (err.code, err.fields) == ("NOT_AUTHORIZED_FOR_TOPIC", {"topic": "acl-t", "operation": "read"})
        frame = consumer.command("CONSUME topic=acl-t partition=0 offset=0 group=g-acl")
        assert frame.status == Status.OK, render(frame)
        # coarse permissions come first
        err = error_of(writer.command("CONSUME topic=acl-t partition=0 offset=0"))
        assert err.code == "NOT_AUTHORIZED_FOR_OPERATION" and err.fields["permission"] == "topic.read"
        # metadata reads follow read_acl; LIST shows only readable topics
        err = error_of(reader.command("METADATA topic=acl-t"))
        assert (err.code, err.fields["operation"]) == ("NOT_AUTHORIZED_FOR_TOPIC", "read")
        assert ok_fields(consumer.command("METADATA topic=acl-t"))["auth_policy"] == "acl"
        assert "acl-t" not in ok_fields(reader.command("LIST"))["topics"].split(",")
        assert "acl-t" in ok_fields(consumer.command("LIST"))["topics"].split(",")
        # read_acl=* / write_acl=*: any authenticated principal with the coarse permission
        ack_of(publish_batch(writer, "star-t", 0, [b"s"]))
        assert reader.command("LIST_OFFSETS topic=star-t").status == Status.OK
        # deny_write keeps working, for everybody
        err = error_of(publish_batch(root, "nowrite-t", 0, [b"x"]))
        assert (err.code, err.fields["operation"]) == ("NOT_AUTHORIZED_FOR_TOPIC", "write")


def test_refused_acks0_publish_stays_silent(secure_broker):
    with login(secure_broker, None) as anon:
        assert publish_batch(anon, "open-t", 1, [b"never"], acks="0") is None
        # the connection is still in step: the next reply answers the next request
        err = error_of(anon.command("LIST"))
        assert err.code == "authentication_required"
    with login(secure_broker, "reader") as reader:
        offsets = ok_fields(reader.command("LIST_OFFSETS topic=open-t partition=1"))["offsets"]
        assert ":leo=0:" in offsets


def test_failed_auth_is_delayed_counted_and_fails_closed(secure_broker):
    host, port = secure_broker.address
    with login(secure_broker, "consumer") as conn:
        assert conn.command("LIST").status == Status.OK
        for principal, token in (("consumer", "wrong"), ("nobody", "tok-consumer-Mm18"), ("consumer", "")):
            started = time.monotonic()
            frame = conn.call(Command.AUTH, {"principal": principal, "token": token})
            err = error_of(frame)
            if token:
                assert err.code == "authentication_failed" and err.error_class.name.lower() == "authorization"
                assert time.monotonic() - started >= DELAY_MS / 1000 * 0.9
            else:
                assert err.code == "invalid_auth"
        # the connection stays usable but is no longer authenticated (a failed AUTH signs it out)
        assert error_of(conn.command("LIST")).code == "authentication_required"
        assert ok_fields(conn.call(Command.AUTH, {"principal": "consumer", "token": USERS["consumer"][0]})) == {
            "principal": "consumer", "authenticated": "true"}
        assert conn.command("LIST").status == Status.OK
    # the SDK raises a typed error for a refused AUTH on connect
    with pytest.raises(AuthenticationError):
        Connection(host, port, principal="root", token="not-the-token")


def test_inline_credentials(secure_broker):
    with login(secure_broker, None) as conn:
        frame = conn.call(Command.LIST, {"principal": "reader", "auth_token": USERS["reader"][0]})
        assert frame.status == Status.OK, render(frame)
        assert conn.command("LIST").status == Status.OK  # the connection is now authenticated
        err = error_of(conn.call(Command.LIST, {"principal": "reader", "auth_token": "bad"}))
        assert err.code == "authentication_failed"
        assert error_of(conn.command("LIST")).code == "authentication_required"
        assert error_of(conn.call(Command.LIST, {"principal": "reader"})).code == "invalid_auth"
        frame = conn.call(Command.CONSUME, {"topic": "acl-t", "partition": "0", "offset": "0",
                                            "principal": "consumer", "auth_token": USERS["consumer"][0]})
        assert frame.status == Status.OK, render(frame)


def test_sdk_admin_with_credentials(secure_broker):
    options = ConnectionOptions(principal="admin", token=USERS["admin"][0])
    assert USERS["admin"][0] not in repr(options)
    host, port = secure_broker.address
    with Admin(f"{host}:{port}", options=options) as admin:
        admin.create_topic("sdk-made", partitions=1)
        with pytest.raises(AuthorizationError) as info:  # admin alone may not read topics
            admin.list_topics()
        assert info.value.fields == {"command": "LIST", "permission": "topic.read"}
    with Admin(f"{host}:{port}", principal="ops", token=USERS["ops"][0]) as admin:
        assert "sdk-made" in admin.list_topics()


def test_no_secret_in_logs_or_metrics(secure_broker):
    # a little traffic of every kind first (failures included)
    with login(secure_broker, None) as conn:
        conn.call(Command.AUTH, {"principal": "root", "token": "tok-root-Q7f3-wrong"})
        conn.call(Command.CREATE, {"topic": "x", "principal": "admin", "auth_token": USERS["admin"][0]})
        conn.send(Command.AUTH, encode_crq2(CommandPayload((), {"principal": "writer", "token": USERS["writer"][0]})))
    url = f"http://127.0.0.1:{secure_broker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        metrics = response.read().decode()
    failures = [line for line in metrics.splitlines() if line.startswith("cursus_auth_failures_total{")]
    assert any('reason="bad_credentials"' in line and float(line.split()[-1]) >= 1 for line in failures), failures
    output = secure_broker.output()
    assert "authentication failed for principal" in output  # failures are logged (without tokens)
    for token in TOKENS:
        assert token not in metrics
        assert token not in output


def _ctl(broker: BrokerProcess, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    host, port = broker.address
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CURSUS_")}
    return subprocess.run([sys.executable, "-m", "cursus.cli.ctl", "--broker", f"{host}:{port}", *args],
                          capture_output=True, text=True, env={**clean, **env}, timeout=60)


def test_cursusctl_credentials(secure_broker, tmp_path):
    token = USERS["ops"][0]
    shown = _ctl(secure_broker, "topic", "list", env={"CURSUS_PRINCIPAL": "ops", "CURSUS_TOKEN": token})
    assert shown.returncode == 0 and "open-t" in shown.stdout, shown.stderr
    shown = _ctl(secure_broker, "--principal", "ops", "--auth-token-env", "MY_TOKEN", "topic", "list",
                 env={"MY_TOKEN": token})
    assert shown.returncode == 0 and "acl-t" in shown.stdout, shown.stderr
    creds = tmp_path / "creds.yaml"
    creds.write_text(f"principal: reader\ntoken: {USERS['reader'][0]}\n")
    shown = _ctl(secure_broker, "--credentials-file", str(creds), "topic", "list", env={})
    assert shown.returncode == 0 and "open-t" in shown.stdout and "acl-t" not in shown.stdout, shown.stderr
    refused = _ctl(secure_broker, "topic", "list", env={})
    assert refused.returncode == 1 and "authentication_required" in refused.stderr
    wrong = _ctl(secure_broker, "topic", "list", env={"CURSUS_PRINCIPAL": "ops", "CURSUS_TOKEN": token + "x"})
    assert wrong.returncode == 1 and "authentication_failed" in wrong.stderr
    usage = _ctl(secure_broker, "--principal", "ops", "topic", "list", env={})
    assert usage.returncode == 2 and "has no token" in usage.stderr
    for result in (shown, refused, wrong, usage):
        assert token not in result.stdout + result.stderr
        assert USERS["reader"][0] not in result.stdout + result.stderr


@pytest.mark.parametrize(("env", "settings", "needle"), [
    ({}, {"enable_sasl": "true"}, "enable_sasl=true needs sasl_users"),
    ({"SASL_USERS": "alice:tok-startup-Rr11"}, {"enable_sasl": "true"}, "principal alice"),
    ({"SASL_USERS": "alice:tok-startup-Rr11:superuser"}, {}, "unknown permission 'superuser'"),
])
def test_invalid_auth_configuration_fails_startup(broker_factory, env, settings, needle):
    broker = broker_factory(settings=settings, env=env)
    broker.start(expect_ready=False)
    assert broker.wait_exit(30) == 2
    output = broker.output()
    assert needle in output and "sasl_users" in output
    assert "tok-startup-Rr11" not in output
