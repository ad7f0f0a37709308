"""The command parameter table: parse once, typed values, the spec's error codes, nothing else escapes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.broker.args import (
    ARGS,
    BatchCommitArgs,
    CommitOffsetArgs,
    DeleteArgs,
    PublishArgs,
    ReadArgs,
)
from cursus.metadata.topics import TopicSpec
from cursus.params import params_of, parse_args, usage
from cursus.wire.errors import REGISTRY, BrokerError


def _code(args_type, fields, positionals=()):
    with pytest.raises(BrokerError) as info:
        parse_args(args_type, fields, "CMD", positionals)
    return info.value.error.code


def test_typed_values_defaults_and_aliases():
    args = parse_args(ReadArgs, {"topic": "t", "partition": "2", "isolation_level": "read_uncommitted",
                                 "auto_offset_reset": "latest", "wait_ms": "100"}, "CONSUME")
    assert (args.topic, args.partition, args.isolation, args.auto_offset_reset) == ("t", 2, "read_uncommitted",
                                                                                    "latest")
    assert args.offset is None and args.wait_ms == 100 and args.batch is None
    publish = parse_args(PublishArgs, {"topic": "t", "producerId": "p", "message": ""}, "PUBLISH")
    assert publish.message == "" and publish.partition == -1 and publish.seq_num == 0 and not publish.idempotent


def test_missing_and_invalid_codes_in_declaration_order():
    assert _code(ReadArgs, {}) == "missing_topic"
    assert _code(ReadArgs, {"topic": "t"}) == "missing_partition"
    assert _code(ReadArgs, {"topic": "t", "partition": "x"}) == "invalid_partition"
    assert _code(ReadArgs, {"topic": "t*", "partition": "0"}) == "invalid_topic_name"
    assert _code(ReadArgs, {"topic": "t", "partition": "0", "offset": "-1"}) == "invalid_offset"
    assert _code(ReadArgs, {"topic": "t", "partition": "0", "isolation": "dirty"}) == "invalid_isolation"
    assert _code(PublishArgs, {"topic": "t"}) == "missing_producer_id"
    assert _code(PublishArgs, {"topic": "t", "producerId": "p"}) == "missing_message"
    assert _code(PublishArgs, {"topic": "t", "producerId": "p", "message": "m", "seqNum": "1_0"}) == "invalid_seq_num"
    assert _code(PublishArgs, {"topic": "t", "producerId": "p", "message": "m", "isIdempotent": "yes"}) \
        == "invalid_is_idempotent"
    assert _code(CommitOffsetArgs, {"topic": "t"}) == "missing_partition"
    assert _code(DeleteArgs, {"topic": "t", "if_exists": "maybe"}) == "invalid_if_exists"


def test_strict_commands_refuse_unknown_fields_but_allow_auth_fields():
    assert _code(TopicSpec, {"topic": "t", "partitons": "3"}) == "invalid_field"
    args = parse_args(TopicSpec, {"topic": "t", "partitions": "3", "principal": "p", "auth_token": "x"}, "CREATE")
    assert args.partitions == 3 and args.replication_factor is None and args.min_in_sync_replicas is None
    assert parse_args(TopicSpec, {"topic": "t", "min_in_sync_replicas": "default"}, "CREATE").min_in_sync_replicas \
        == "default"
    assert _code(TopicSpec, {"topic": "t", "partitions": "0"}) == "invalid_partitions"
    assert _code(TopicSpec, {"topic": "t", "partitions": "99999"}) == "invalid_partitions"
    assert _code(TopicSpec, {"topic": "t", "cleanup_policy": "shred"}) == "invalid_topic_policy"
    assert parse_args(TopicSpec, {"topic": "t", "read_acl": " a, ,b "}, "CREATE").read_acl == ("a", "b")


def test_flags_and_positionals():
    base = {"topic": "t", "partition": "0", "offset": "5", "group": "g", "member": "m-0001", "generation": "1"}
    assert parse_args(CommitOffsetArgs, {**base, "ownership_only": "YES"}, "COMMIT_OFFSET").validate_only
    assert not parse_args(CommitOffsetArgs, {**base, "validate_only": "nope"}, "COMMIT_OFFSET").validate_only
    batch = parse_args(BatchCommitArgs, {"topic": "t", "group": "g", "member": "m", "generation": "1"},
                       "BATCH_COMMIT", ("P0:1",))
    assert batch.offsets is None and batch.positionals == ("P0:1",)


def test_every_declared_error_code_is_registered_and_usage_renders():
    for command, args_type in ARGS.items():
        for _, p in params_of(args_type):
            if p.kind not in ("custom", "flag", "csv", "str"):
                assert (p.invalid or f"invalid_{p.name}") in REGISTRY, (command, p.name)
            if p.required:
                assert (p.missing or f"missing_{p.name}") in REGISTRY, (command, p.name)
        assert usage(command.name, args_type).startswith(command.name)


_FIELD = st.sampled_from(sorted({p.name for t in ARGS.values() for _, p in params_of(t)} | {"x", "principal"}))
_VALUE = st.one_of(st.text(max_size=12), st.integers(-(1 << 70), 1 << 70).map(str),
                   st.sampled_from(["true", "FALSE", "default", "", "-1", "0", "read_committed", "P0:1"]))


@given(st.sampled_from(sorted(set(ARGS.values()), key=lambda t: t.__name__)),
       st.dictionaries(_FIELD, _VALUE, max_size=8), st.lists(st.text(max_size=5), max_size=2))
def test_any_input_parses_or_raises_a_registered_typed_error(args_type, fields, positionals):
    try:
        parse_args(args_type, fields, "CMD", positionals)
    except BrokerError as exc:
        assert exc.error.code in REGISTRY


def test_commands_page_is_generated_from_the_table():
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    generated = subprocess.run([sys.executable, "-m", "cursus.broker.args"], capture_output=True, text=True,
                               check=True).stdout
    page = (REPO_ROOT / "docs" / "commands.md").read_text()
    assert page == generated, "regenerate: python -m cursus.broker.args > docs/commands.md"


def test_create_treats_an_empty_value_as_malformed_not_omitted():
    assert _code(TopicSpec, {"topic": "t", "partitions": ""}) == "invalid_partitions"
    assert _code(TopicSpec, {"topic": "t", "cleanup_policy": ""}) == "invalid_topic_policy"
    assert _code(TopicSpec, {"topic": "t", "min_in_sync_replicas": ""}) == "invalid_min_in_sync_replicas"
    assert _code(TopicSpec, {"topic": ""}) == "missing_topic"
