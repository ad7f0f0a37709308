"""Everyday-use defects of ``cursusctl`` and the SDK (issue 19), each reproduced against a real broker."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from cursus.client import (
    Admin,
    ConflictError,
    Consumer,
    CursusError,
    DeliveryFailedError,
    GroupConsumer,
    OffsetOutOfRangeError,
    Producer,
)
from cursus.wire import Status
from tests.integration.conftest import connect
from tests.integration.helpers import create_topic, publish_batch, wait_for

pytestmark = pytest.mark.timeout(90)


def ctl(broker, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CURSUS_BROKER": broker.bootstrap}
    return subprocess.run([sys.executable, "-m", "cursus.cli.ctl", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=60)


def group_status(broker, group: str) -> dict:
    """The GROUP_STATUS document, or {} while the group does not exist."""
    with connect(broker) as conn:
        frame = conn.command(f"GROUP_STATUS group={group}")
    return json.loads(frame.payload) if frame.status == Status.OK else {}


# ------------------------------------------------------------------------------ option abbreviations


def test_key_is_a_static_key_and_option_prefixes_are_refused(shared_broker, topic_name):
    assert ctl(shared_broker, "topic", "create", topic_name).returncode == 0
    produced = ctl(shared_broker, "produce", topic_name, "--key", "k1", stdin="order-k1-payload\n")
    assert produced.returncode == 0, produced.stderr
    short = ctl(shared_broker, "produce", topic_name, "-k", "k2", stdin="second\n")
    assert short.returncode == 0, short.stderr
    consumed = ctl(shared_broker, "--json", "consume", topic_name, "--offset", "0")
    docs = [json.loads(line) for line in consumed.stdout.splitlines()]
    assert sorted((d["key"], d["value"]) for d in docs) == [("k1", "order-k1-payload"), ("k2", "second")]
    # a prefix of a longer option is not that option: usage error, nothing produced
    for argv in (["produce", topic_name, "--key-s", ":"], ["produce", topic_name, "--idem"],
                 ["consume", topic_name, "--from"], ["consume", topic_name, "--off", "0"],
                 ["consume", topic_name, "--part", "0"], ["produce", topic_name, "--key", "a", "--key-sep", ":"]):
        refused = ctl(shared_broker, *argv, stdin="x:y\n")
        assert refused.returncode == 2, (argv, refused.stdout, refused.stderr)
    with Admin(shared_broker.bootstrap) as admin:
        assert sum(o.latest for o in admin.list_offsets(topic_name)) == 2


# ------------------------------------------------------------------------------ SIGTERM leaves the group


MEMBER_SCRIPT = r"""
import sys
from cursus.client import GroupConsumer
topic, group, address = sys.argv[1:4]
with GroupConsumer(topic, group, address, client_id="sdk", heartbeat_interval_s=0.5) as consumer:
    consumer.assignment()
    print("joined", flush=True)
    while True:
        consumer.poll(0.2)
"""


@pytest.mark.parametrize("how", ["cursusctl", "sdk"])
def test_sigterm_leaves_the_group(shared_broker, topic_name, how):
    group = f"g-{topic_name}"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
    env = {**os.environ, "CURSUS_BROKER": shared_broker.bootstrap}
    if how == "cursusctl":
        argv = [sys.executable, "-m", "cursus.cli.ctl", "consume", topic_name, "--group", group, "--follow"]
    else:
        argv = [sys.executable, "-c", MEMBER_SCRIPT, topic_name, group, shared_broker.bootstrap]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: group_status(shared_broker, group).get("member_count") == 1, 20, "the member to join")
        if how == "sdk":  # the broker counts the member before the client has its JoinGroup reply: wait for it
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 20)
            assert ready and proc.stdout.readline().strip() == "joined", "the SDK member never finished joining"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    doc = group_status(shared_broker, group)
    assert doc["member_count"] == 0 and doc["state"] == "Empty"  # left at once, not after the session timeout
    deleted = ctl(shared_broker, "topic", "delete", topic_name)
    assert deleted.returncode == 0, deleted.stderr


# ------------------------------------------------------------------------------ SDK commits


def test_group_commit_refusals_raise_and_the_consumer_joins_eagerly(shared_broker, topic_name):
    address = shared_broker.bootstrap
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        for p in range(2):
            publish_batch(conn, topic_name, p, [b"x"] * 200)
    with GroupConsumer(topic_name, f"g-{topic_name}", address, auto_commit=False) as consumer:
        assert consumer.member_id is not None and consumer.generation == 1  # joined, before any poll
        assert consumer.commit({0: 150}) == {0: 150}
        with pytest.raises(ConflictError) as regression:
            consumer.commit({0: 100})
        assert regression.value.code == "offset_regression"
        assert consumer.commit({0: 150}) == {}  # the committed value again: nothing to do
        with pytest.raises(CursusError) as missing:
            consumer.commit({9: 1})  # not dropped silently either
        assert missing.value.code == "partition_not_found"
    with GroupConsumer(topic_name, f"g2-{topic_name}", address, auto_commit=False) as fresh:
        assert fresh.commit() == {}  # nothing polled yet: nothing to commit, but it is a member
        assert fresh.assignment() == [0, 1] and fresh.member_id


# ------------------------------------------------------------------------------ sizes and ranges


def test_an_oversized_record_fails_client_side_with_any_acks(shared_broker, topic_name):
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "1").returncode == 0
    big = "x" * (1024 * 1024 + 10)
    produced = ctl(shared_broker, "--json", "produce", topic_name, "--acks", "0", stdin=f"small\n{big}\nsmall\n")
    assert produced.returncode == 1, produced.stdout
    summary = json.loads(produced.stdout.splitlines()[0])
    assert summary["records"] == 2 and summary["failed"] == 1
    assert "message_too_large" in produced.stderr
    with Producer(shared_broker.bootstrap, acks=0, max_record_bytes=1000) as producer:
        future = producer.send(topic_name, b"y" * 1000)
        with pytest.raises(DeliveryFailedError) as failed:
            producer.flush()
    assert failed.value.failed_count == 1 and future.exception().code == "message_too_large"


def test_an_out_of_range_start_is_an_error(shared_broker, topic_name):
    address = shared_broker.bootstrap
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=1)
        publish_batch(conn, topic_name, 0, [b"a", b"b"])
    with Consumer(topic_name, address, start=999999, auto_offset_reset="error") as consumer:
        with pytest.raises(OffsetOutOfRangeError) as err:
            list(consumer.records(until_end=True))
        assert (err.value.requested, err.value.earliest, err.value.latest) == (999999, 0, 2)
    with Consumer(topic_name, address, start=999999, auto_offset_reset="earliest") as consumer:
        assert [r.value for r in consumer.records(until_end=True)] == [b"a", b"b"]
    printed = ctl(shared_broker, "consume", topic_name, "--partition", "0", "--offset", "999999")
    assert printed.returncode == 1 and printed.stderr.startswith("ERROR: OFFSET_OUT_OF_RANGE"), printed.stderr
    assert ctl(shared_broker, "consume", topic_name, "--offset", "1").stdout == "b\n"


# ------------------------------------------------------------------------------ help and startup log


def test_create_help_offers_only_accepted_policies_and_a_new_data_directory_says_so(broker_factory):
    shown = subprocess.run([sys.executable, "-m", "cursus.cli.ctl", "topic", "create", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0
    assert "{delete,compact,delete,compact}" in shown.stdout
    assert "{open,deny_write,deny_read,acl}" in shown.stdout
    broker = broker_factory().start()
    wait_for(lambda: "recovered" in broker.output(), 10, "the recovery log line")
    assert "(new data directory)" in broker.output() and "clean shutdown: False" not in broker.output()
    assert broker.terminate() == 0
    broker.start()
    wait_for(lambda: "clean shutdown: True" in broker.output(), 10, "the clean restart's log line")


def test_topic_create_says_what_happened_and_if_not_exists_leaves_it(shared_broker, topic_name):
    def create(*extra: str) -> dict:
        done = ctl(shared_broker, "--json", "topic", "create", topic_name, *extra)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    first = create("--partitions", "2")
    assert first["result"] == "created" and first["partitions"] == 2
    again = create("--partitions", "2")
    assert again["result"] == "unchanged" and again["revision"] == first["revision"]
    grown = create("--partitions", "3")
    assert grown["result"] == "updated" and grown["revision"] > first["revision"]
    kept = create("--partitions", "5", "--if-not-exists")
    assert kept == {"result": "exists", "topic": topic_name, "revision": grown["revision"]}
    assert create("--partitions", "3")["partitions"] == 3  # --if-not-exists changed nothing
    plain = ctl(shared_broker, "topic", "create", topic_name, "--if-not-exists")
    assert "result=exists" in plain.stdout


def test_admin_lists_describes_and_measures_groups(shared_broker, topic_name):
    address = shared_broker.bootstrap
    group = f"g-{topic_name}"
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=2)
        for p in range(2):
            publish_batch(conn, topic_name, p, [b"x"] * 10)
    with GroupConsumer(topic_name, group, address, auto_commit=False) as consumer:
        consumer.commit({0: 4})
        with Admin(address) as admin:
            assert group in admin.list_groups()
            doc = admin.describe_group(group)
            assert doc["state"] == "Stable" and doc["members"][0]["member_id"] == consumer.member_id
            offsets = admin.group_offsets(group)
            assert [(o.partition, o.committed, o.log_end, o.lag, o.owner) for o in offsets] == [
                (0, 4, 10, 6, consumer.member_id), (1, None, 10, 10, consumer.member_id)]
            assert admin.group_lag(group) == 16
            with pytest.raises(CursusError) as missing:
                admin.describe_group(f"{group}-none")
            assert missing.value.code == "group_not_found"


def test_errors_say_what_to_do_next(shared_broker, topic_name):
    missing = ctl(shared_broker, "consume", f"{topic_name}-nope")
    assert missing.returncode == 1
    assert f"create it with: cursusctl topic create {topic_name}-nope" in missing.stderr
    with connect(shared_broker) as conn:
        create_topic(conn, topic_name, partitions=1)
    with GroupConsumer(topic_name, f"g-{topic_name}", shared_broker.bootstrap) as consumer:
        member = consumer.member_id
        blocked = ctl(shared_broker, "topic", "delete", topic_name)
    assert blocked.returncode == 1 and blocked.stderr.startswith("ERROR: topic_delete_blocked")
    assert f"still has members ({member})" in blocked.stderr and "30 s" in blocked.stderr
    assert ctl(shared_broker, "topic", "delete", topic_name).returncode == 0  # the member left on close


def test_records_carry_their_create_time_by_default(shared_broker, topic_name):
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "1").returncode == 0
    before = int(time.time() * 1000)
    assert ctl(shared_broker, "produce", topic_name, stdin="a\n").returncode == 0
    with Producer(shared_broker.bootstrap) as producer:
        producer.send(topic_name, b"b")
        producer.send(topic_name, b"c", timestamp_ms=7)
    after = int(time.time() * 1000)
    with Consumer(topic_name, shared_broker.bootstrap) as consumer:
        stamps = [r.timestamp for r in consumer.records(until_end=True)]
    assert all(before <= t <= after for t in stamps[:2]) and stamps[2] == 7


def test_metadata_without_a_topic_is_a_cluster_view(shared_broker, topic_name):
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    doc = json.loads(ctl(shared_broker, "--json", "metadata").stdout)
    assert doc["brokers"] == [shared_broker.bootstrap]
    mine = [t for t in doc["topics"] if t["topic"] == topic_name]
    assert len(mine) == 1 and mine[0]["partitions"] == 2
    plain = ctl(shared_broker, "metadata")
    assert plain.returncode == 0 and f"brokers={shared_broker.bootstrap}" in plain.stdout


def test_topic_create_and_delete_take_several_topics(shared_broker, topic_name):
    names = [f"{topic_name}-{i}" for i in range(3)]
    created = ctl(shared_broker, "--json", "topic", "create", *names, "--partitions", "2")
    assert created.returncode == 0, created.stderr
    assert [json.loads(line)["topic"] for line in created.stdout.splitlines()] == names
    deleted = ctl(shared_broker, "--json", "topic", "delete", *names)
    assert [json.loads(line)["deleted"] for line in deleted.stdout.splitlines()] == [True] * 3
