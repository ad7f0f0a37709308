"""cursusctl end to end: every subcommand, exit codes (0 ok, 1 broker/runtime error, 2 usage), --json,
tables on a terminal and plain lines in a pipe."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from cursus.client import GroupConsumer, Producer

pytestmark = pytest.mark.timeout(90)
ERROR_PREFIX = "ERROR: topic_not_found class=not_found retryable=false"
GROUP_NOT_FOUND = "ERROR: group_not_found class=not_found retryable=false"


def _addr(broker) -> str:
    host, port = broker.address
    return f"{host}:{port}"


def ctl(broker, *args: str, stdin: str | None = None, env: dict[str, str] | None = None,
        broker_flag: bool = False) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "CURSUS_BROKER": _addr(broker) if broker is not None else "", **(env or {})}
    argv = [sys.executable, "-m", "cursus.cli.ctl"]
    if broker_flag and broker is not None:
        argv += ["--broker", _addr(broker)]
    return subprocess.run(argv + list(args), input=stdin, capture_output=True, text=True, env=full_env, timeout=60)


def _fields(line: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in line.split() if "=" in token)


def test_topic_subcommands(shared_broker, topic_name):
    created = ctl(shared_broker, "topic", "create", topic_name, "--partitions", "3", "--retention-hours", "2",
                  broker_flag=True)
    assert created.returncode == 0, created.stderr
    fields = _fields(created.stdout)
    assert fields["topic"] == topic_name and fields["partitions"] == "3" and fields["retention_hours"] == "2"
    again = ctl(shared_broker, "--json", "topic", "create", topic_name, "--partitions", "4")
    assert again.returncode == 0 and json.loads(again.stdout)["partitions"] == 4

    listed = ctl(shared_broker, "topic", "list")
    assert listed.returncode == 0 and topic_name in listed.stdout.splitlines()
    listed_json = ctl(shared_broker, "topic", "list", "--json")  # global flags work after the subcommand
    assert topic_name in json.loads(listed_json.stdout)["topics"]

    described = ctl(shared_broker, "topic", "describe", topic_name)
    assert described.returncode == 0 and "partition=3" in described.stdout
    described_json = json.loads(ctl(shared_broker, "--json", "topic", "describe", topic_name).stdout)
    assert described_json["topic"] == topic_name and len(described_json["partitions"]) == 4

    altered = ctl(shared_broker, "--json", "topic", "alter", topic_name, "--min-isr", "default")
    assert altered.returncode == 0 and json.loads(altered.stdout)["min_in_sync_replicas"] is None
    bad_alter = ctl(shared_broker, "topic", "alter", topic_name, "--min-isr", "7")
    assert bad_alter.returncode == 1 and bad_alter.stderr.startswith("ERROR: invalid_min_in_sync_replicas")

    truncated = ctl(shared_broker, "topic", "truncate", topic_name)
    assert truncated.returncode == 0, truncated.stderr
    assert _fields(truncated.stdout)["lifecycle_epoch"] == "1" and _fields(truncated.stdout)["leo"] == "0"
    stale = ctl(shared_broker, "--json", "topic", "truncate", topic_name, "--expected-revision", "1")
    assert stale.returncode == 1 and json.loads(stale.stdout)["code"] == "version_conflict"

    deleted = ctl(shared_broker, "topic", "delete", topic_name)
    assert deleted.returncode == 0 and _fields(deleted.stdout)["deleted"] == "true"
    missing = ctl(shared_broker, "topic", "delete", topic_name)
    assert missing.returncode == 1 and missing.stderr.startswith(ERROR_PREFIX)
    missing_json = ctl(shared_broker, "--json", "topic", "delete", topic_name)
    doc = json.loads(missing_json.stdout)
    assert missing_json.returncode == 1 and doc["code"] == "topic_not_found" and doc["class"] == "not_found"
    quiet = ctl(shared_broker, "--json", "topic", "delete", topic_name, "--if-exists")
    assert quiet.returncode == 0 and json.loads(quiet.stdout)["deleted"] is False


def test_produce_and_consume(shared_broker, topic_name, tmp_path):
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    produced = ctl(shared_broker, "produce", topic_name, "--key-sep", ":", stdin="k1:v1\nk2:v2\nk1:v3\nnokey\n")
    assert produced.returncode == 0, produced.stderr
    summary = _fields(produced.stdout.splitlines()[0])
    assert summary["records"] == "4" and summary["failed"] == "0"
    data = tmp_path / "lines.txt"
    data.write_bytes(b"f1\nf2\r\n")
    from_file = ctl(shared_broker, "--json", "produce", topic_name, "--file", str(data), "--partition", "1",
                    "--idempotent")
    doc = json.loads(from_file.stdout)
    assert from_file.returncode == 0 and doc["records"] == 2 and list(doc["partitions"]) == ["1"]

    text = ctl(shared_broker, "consume", topic_name, "--from-beginning", "--key-sep", "=")
    assert text.returncode == 0
    assert sorted(text.stdout.splitlines()) == sorted(["k1=v1", "k2=v2", "k1=v3", "=nokey", "=f1", "=f2"])
    as_json = ctl(shared_broker, "consume", topic_name, "--from-beginning", "--format", "json", "--partition", "1")
    records = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [r["value"] for r in records][-2:] == ["f1", "f2"] and all(r["partition"] == 1 for r in records)
    assert records[-1]["producer_id"].startswith("py-") and records[-1]["seq_num"] == 2
    hexed = ctl(shared_broker, "consume", topic_name, "--partition", "1", "--offset", "-1", "--format", "hex")
    assert hexed.stdout.split("\t")[-1].strip() == b"f2".hex()
    limited = ctl(shared_broker, "--json", "consume", topic_name, "--from-beginning", "--max", "2")
    assert len(limited.stdout.splitlines()) == 2
    everything = ctl(shared_broker, "consume", topic_name)  # default: from the start, as rpk and kcat
    assert everything.returncode == 0 and len(everything.stdout.splitlines()) == 6
    tail = ctl(shared_broker, "consume", topic_name, "--offset", "end")  # without --follow: nothing
    assert tail.returncode == 0 and tail.stdout == ""
    templated = ctl(shared_broker, "consume", topic_name, "--partition", "1", "--offset", "-1",
                    "--format", r"%t|%p|%o|%k|%v|%%\n")
    offset = hexed.stdout.split("\t")[1]
    assert templated.stdout == f"{topic_name}|1|{offset}||f2|%\n", templated.stdout
    followed = ctl(shared_broker, "consume", topic_name, "--from-beginning", "--follow", "--max", "6",
                   "--wait-ms", "100")
    assert followed.returncode == 0 and len(followed.stdout.splitlines()) == 6
    fire = ctl(shared_broker, "produce", topic_name, "--acks", "0", "--partition", "0", stdin="zero\n")
    assert fire.returncode == 0 and _fields(fire.stdout.splitlines()[1])["first_offset"] == "-"


def test_offsets_and_metadata(shared_broker, topic_name):
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    with Producer(_addr(shared_broker)) as producer:
        for _ in range(3):
            producer.send(topic_name, b"x", partition=1)
    offsets = ctl(shared_broker, "offsets", topic_name)
    assert offsets.returncode == 0
    assert [_fields(line) for line in offsets.stdout.splitlines()] == [
        {"partition": "0", "earliest": "0", "latest": "0", "leo": "0", "hwm": "0"},
        {"partition": "1", "earliest": "0", "latest": "3", "leo": "3", "hwm": "3"}]
    one = json.loads(ctl(shared_broker, "--json", "offsets", topic_name, "--partition", "1").stdout)
    assert one["partitions"] == [{"partition": 1, "earliest": 0, "latest": 3, "leo": 3, "hwm": 3}]
    metadata = ctl(shared_broker, "metadata", topic_name)
    lines = metadata.stdout.splitlines()
    assert metadata.returncode == 0 and _fields(lines[0])["partitions"] == "2"
    assert _fields(lines[1]) == {"partition": "0", "leader": _addr(shared_broker), "epoch": "0"}
    as_json = json.loads(ctl(shared_broker, "--json", "metadata", topic_name).stdout)
    assert as_json["leaders"] == [_addr(shared_broker)] * 2
    missing = ctl(shared_broker, "offsets", "missing-topic-ctl")
    assert missing.returncode == 1 and missing.stderr.startswith(ERROR_PREFIX)


def test_raw(shared_broker, topic_name):
    assert ctl(shared_broker, "raw", "CREATE", f"topic={topic_name}", "partitions=1").returncode == 0
    published = ctl(shared_broker, "raw", "PUBLISH", f"topic={topic_name}", "acks=1", "producerId=ctl",
                    "message=hello raw world")
    assert published.returncode == 0 and json.loads(published.stdout)["last_offset"] == 0
    assert ctl(shared_broker, "raw", "PUBLISH", f"topic={topic_name}", "acks=0", "producerId=ctl",
               "message=quiet").stdout == ""
    listed = ctl(shared_broker, "raw", "list")
    assert listed.returncode == 0 and listed.stdout.startswith("OK count=")
    listed_json = json.loads(ctl(shared_broker, "--json", "raw", "LIST").stdout)
    assert topic_name in listed_json["fields"]["topics"].split(",")
    consumed = ctl(shared_broker, "raw", "CONSUME", f"topic={topic_name}", "partition=0", "offset=0")
    lines = consumed.stdout.splitlines()
    assert lines[0] == "OK records=2" and json.loads(lines[1])["value"] == "hello raw world"
    error = ctl(shared_broker, "raw", "METADATA", "topic=missing-topic-raw")
    assert error.returncode == 1 and error.stdout.startswith(ERROR_PREFIX + " topic=missing-topic-raw")
    error_json = json.loads(ctl(shared_broker, "--json", "raw", "METADATA", "topic=missing-topic-raw").stdout)
    assert error_json["status"] == "ERROR" and error_json["fields"] == {"topic": "missing-topic-raw"}
    assert ctl(shared_broker, "raw", "NOPE", "a=b").returncode == 2
    assert ctl(shared_broker, "raw", "LIST", "a=1", "a=2").returncode == 2  # duplicate field


def test_usage_and_connection_errors(shared_broker, tmp_path):
    bare = ctl(shared_broker)  # bare cursusctl: the help, like rpk
    assert bare.returncode == 0 and bare.stdout.startswith("usage: cursusctl") and "COMMAND" in bare.stdout
    version = ctl(shared_broker, "--version")
    assert version.returncode == 0 and version.stdout.startswith("cursusctl ")
    assert ctl(shared_broker, "--timeout", "soon", "topic", "list").returncode == 2
    assert ctl(shared_broker, "--broker", "host:notaport", "topic", "list").returncode == 2
    assert ctl(shared_broker, "--compression", "zstd", "topic", "list").returncode == 2
    unset = ctl(shared_broker, "--principal", "p", "--auth-token-env", "CURSUSCTL_UNSET_VAR", "topic", "list")
    assert unset.returncode == 2 and "CURSUSCTL_UNSET_VAR" in unset.stderr
    assert ctl(shared_broker, "--tls-cert", str(tmp_path / "c.pem"), "topic", "list").returncode == 2
    assert ctl(shared_broker, "consume", "t", "--offset", "1", "--from-beginning").returncode == 2
    assert ctl(shared_broker, "--help").returncode == 0
    down = ctl(None, "--broker", "127.0.0.1:1", "--timeout", "1s", "topic", "list")
    assert down.returncode == 1 and down.stderr.startswith("ERROR: broker_unavailable class=availability")
    with_compression = ctl(shared_broker, "--compression", "snappy", "--timeout", "5s", "topic", "list")
    assert with_compression.returncode == 0
    assert ctl(shared_broker, "produce", "t", "--file", str(tmp_path / "missing.txt")).returncode == 1


def _on_terminal(broker, *args: str) -> str:
    """Run cursusctl with stdout on a pseudo-terminal; returns what it printed (asserts exit code 0)."""
    controller, terminal = pty.openpty()
    env = {**os.environ, "CURSUS_BROKER": _addr(broker), "COLUMNS": "160", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "cursus.cli.ctl", *args], stdout=terminal,
                            stderr=subprocess.PIPE, env=env)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=30) == 0
    return b"".join(chunks).decode("utf-8", "replace")


def test_tables_on_a_terminal(shared_broker, topic_name):
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    screen = _on_terminal(shared_broker, "offsets", topic_name)
    assert "earliest" in screen and any(ch in screen for ch in "━─┃│")  # a rich table, not k=v lines
    assert "partition=" not in screen


def test_group_subcommands(shared_broker, topic_name):
    group = f"g-{topic_name}"
    assert ctl(shared_broker, "topic", "create", topic_name, "--partitions", "2").returncode == 0
    with Producer(_addr(shared_broker)) as producer:
        for i in range(5):
            producer.send(topic_name, f"v{i}".encode(), partition=0 if i < 3 else 1)

    missing = ctl(shared_broker, "group", "describe", f"{group}-missing")
    assert missing.returncode == 1 and missing.stderr.startswith(GROUP_NOT_FOUND)
    assert missing.stdout == ""
    missing_json = ctl(shared_broker, "--json", "group", "offsets", f"{group}-missing")
    doc = json.loads(missing_json.stdout)
    assert missing_json.returncode == 1 and doc["code"] == "group_not_found" and doc["class"] == "not_found"
    assert doc["fields"] == {"group": f"{group}-missing"}

    # consume --group: starts at the committed offsets (none yet: the start), commits what it printed.
    first = ctl(shared_broker, "consume", topic_name, "--group", group, "--max", "3")
    assert first.returncode == 0, first.stderr
    assert len(first.stdout.splitlines()) == 3
    rows = [_fields(line) for line in ctl(shared_broker, "group", "offsets", group).stdout.splitlines()]
    assert [(r["topic"], r["partition"], r["log_end"], r["owner"]) for r in rows] == [
        (topic_name, "0", "3", "-"), (topic_name, "1", "2", "-")]  # the member left on exit
    assert sum(int(r["committed"]) for r in rows if r["committed"] != "-") == 3
    assert sum(int(r["lag"]) for r in rows) == 2
    rest = ctl(shared_broker, "consume", topic_name, "--group", group, "--mode", "poll")
    assert rest.returncode == 0, rest.stderr
    assert sorted(first.stdout.splitlines() + rest.stdout.splitlines()) == [f"v{i}" for i in range(5)]
    again = ctl(shared_broker, "consume", topic_name, "--group", group)
    assert again.returncode == 0 and again.stdout == ""

    listed = ctl(shared_broker, "group", "list")
    assert listed.returncode == 0 and group in listed.stdout.splitlines()
    listed_json = json.loads(ctl(shared_broker, "group", "list", "--json").stdout)
    assert group in listed_json["groups"] and listed_json["count"] == len(listed_json["groups"])

    with GroupConsumer(topic_name, group, _addr(shared_broker), client_id="sdk", auto_commit=False) as member:
        assert member.assignment() == [0, 1]
        described = ctl(shared_broker, "group", "describe", group)
        assert described.returncode == 0, described.stderr
        summary, *members = [_fields(line) for line in described.stdout.splitlines()]
        assert summary["group"] == group and summary["state"] == "Stable" and summary["members"] == "1"
        assert summary["generation"] == str(member.generation) and summary["topics"] == topic_name
        assert [(m["member"], m["assignments"]) for m in members] == [(member.member_id, "0,1")]
        as_json = json.loads(ctl(shared_broker, "--json", "group", "describe", group).stdout)
        assert as_json["state"] == "Stable" and as_json["generation"] == member.generation
        assert [(m["member_id"], m["assignments"]) for m in as_json["members"]] == [(member.member_id, [0, 1])]
        offsets = json.loads(ctl(shared_broker, "--json", "group", "offsets", group).stdout)
        assert offsets["total_lag"] == 0 and offsets["group"] == group
        assert [(o["partition"], o["committed_offset"], o["log_end_offset"], o["owner"])
                for o in offsets["offsets"]] == [(0, 3, 3, member.member_id), (1, 2, 2, member.member_id)]
        screen = _on_terminal(shared_broker, "group", "describe", group)
        assert member.member_id in screen and any(ch in screen for ch in "━─┃│") and "member=" not in screen
    left = json.loads(ctl(shared_broker, "--json", "group", "describe", group).stdout)
    assert left["state"] == "Empty" and left["members"] == []

    streamed = ctl(shared_broker, "--json", "consume", topic_name, "--group", f"{group}-s", "--mode", "stream",
                   "--follow", "--max", "5")
    assert streamed.returncode == 0, streamed.stderr
    records = [json.loads(line) for line in streamed.stdout.splitlines()]
    assert sorted((r["partition"], r["offset"]) for r in records) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert json.loads(ctl(shared_broker, "--json", "group", "offsets", f"{group}-s").stdout)["total_lag"] == 0

    assert ctl(shared_broker, "consume", topic_name, "--group", group, "--partition", "0").returncode == 2
    assert ctl(shared_broker, "consume", topic_name, "--group", group, "--offset", "1").returncode == 2
    assert ctl(shared_broker, "consume", topic_name, "--group", group, "--from-beginning",
               "--reset", "latest").returncode == 2
    assert ctl(shared_broker, "consume", topic_name, "--mode", "stream").returncode == 2
    assert ctl(shared_broker, "group").returncode == 2
    no_topic = ctl(shared_broker, "consume", f"{topic_name}-missing", "--group", group)
    assert no_topic.returncode == 1 and no_topic.stderr.startswith(ERROR_PREFIX)
