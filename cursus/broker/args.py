"""Every served command's parameters, as data (spec sections per command; facts B5 for reply shapes).

One frozen dataclass per command; :func:`cursus.params.parse_args` builds it from a request, so a
handler receives validated, typed values. Field order is validation order. :data:`ARGS` maps each command
to its type; HELP and ``docs/commands.md`` are rendered from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cursus.coordinator.groups import validate_group_name, validate_member_id
from cursus.metadata.topics import TopicSpec, min_isr_value, topic_name, validate_topic_name
from cursus.params import Args, param, params_of
from cursus.parsing import I32_MAX, I64_MAX, U64_MAX, parse_int
from cursus.wire import Command
from cursus.wire.errors import BrokerError

# --------------------------------------------------------------------------------------------- converters

#: acks strings (facts decision 11) -> ack mode label: "none" suppresses the reply.
ACK_MODES = {"0": "none", "none": "none", "": "leader", "1": "leader", "all": "all", "-1": "all"}


def parse_acks(raw: str | None) -> str:
    """Map an acks value to ``none`` / ``leader`` / ``all``. Raises BrokerError ``invalid_acks``."""
    mode = ACK_MODES.get((raw if raw is not None else "1").strip().lower())
    if mode is None:
        raise BrokerError.of("invalid_acks", value=raw)
    return mode



def read_topic_name(raw: str, command: str) -> str:
    """`invalid_topic_name` unless a topic name (no wildcards: they belong to group subscriptions)"""
    if "*" in raw or "?" in raw:
        raise BrokerError.of("invalid_topic_name", topic=raw, reason="wildcards belong to group subscriptions")
    return validate_topic_name(raw, command=command)


def group_name(raw: str, command: str) -> str:
    """`invalid_payload field=group` unless 1-249 of A-Z a-z 0-9 . _ = : @ + / -"""
    return validate_group_name(raw, command=command)


def member_id(raw: str, command: str) -> str:
    """`invalid_payload field=member` unless 1-244 of A-Z a-z 0-9 . _ = : @ + / -"""
    return validate_member_id(raw, command=command)





def acks_mode(raw: str, command: str) -> str:
    """`invalid_acks` unless 0, none, 1, all or -1 (the mode: none, leader or all)"""
    return parse_acks(raw)


def isolation(raw: str, command: str) -> str:
    """`invalid_isolation` unless read_committed or read_uncommitted"""
    if raw not in ("read_committed", "read_uncommitted"):
        raise BrokerError.of("invalid_isolation", value=raw, command=command)
    return raw



# ------------------------------------------------------------------------------------------ session commands


@dataclass(frozen=True)
class AuthArgs(Args):
    """AUTH principal= token= (with enable_sasl=false: answered authenticated=false)."""

    principal: str = param(default="", doc="who is authenticating")
    token: str = param(default="", doc="the principal's secret token (never logged)")


@dataclass(frozen=True)
class NoArgs(Args):
    """EXIT, HELP, LIST, LIST_GROUPS: no parameters."""


# -------------------------------------------------------------------------------------------- topic commands


@dataclass(frozen=True)
class AlterTopicConfigArgs(Args):
    """ALTER_TOPIC_CONFIG topic= min_in_sync_replicas=N|default."""

    STRICT = True
    topic: str = param(kind="custom", convert=topic_name, required=True)
    min_in_sync_replicas: int | str = param(kind="custom", convert=min_isr_value, required=True, default="default")


@dataclass(frozen=True)
class DeleteArgs(Args):
    """DELETE topic= [if_exists=true|false]."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    if_exists: bool = param(kind="bool", default=False, doc="no error when the topic is absent")


@dataclass(frozen=True)
class TruncateArgs(Args):
    """TRUNCATE topic= expected_revision=N (admin only)."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    expected_revision: int = param(kind="int", required=True, minimum=1,
                                   doc="the topic's current definition revision (compare-and-set)")


@dataclass(frozen=True)
class TopicArgs(Args):
    """METADATA / DESCRIBE topic=."""

    topic: str = param(kind="custom", convert=topic_name, required=True)


@dataclass(frozen=True)
class ListOffsetsArgs(Args):
    """LIST_OFFSETS topic= [partition=]."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    partition: int | None = param(kind="int", invalid="invalid_partition")


# ----------------------------------------------------------------------------------------- produce / fetch


@dataclass(frozen=True)
class PublishArgs(Args):
    """Text PUBLISH topic= producerId= message= [acks=] [partition=] [key=] [isIdempotent=] [seqNum=] [epoch=].

    (A CBV2 batch PUBLISH carries these in its batch header instead: see :func:`cursus.wire.scan_batch`.)
    """

    acks: str = param(kind="custom", convert=acks_mode, default="leader", doc="0 | 1 | all | -1 (default 1)")
    topic: str = param(kind="custom", convert=topic_name, required=True)
    producer_id: str = param("producerId", required=True, missing="missing_producer_id")
    message: str = param(required=True, empty_ok=True)
    idempotent: bool = param("isIdempotent", kind="bool", default=False, invalid="invalid_is_idempotent")
    seq_num: int = param("seqNum", kind="int", default=0, minimum=0, maximum=U64_MAX, invalid="invalid_seq_num")
    epoch: int = param(kind="int", default=0, invalid="invalid_epoch",
                       doc="idempotent (isIdempotent=true or CBV2 flag bit 0): < 0 is invalid_epoch")
    key: str | None = param(empty_ok=True)
    partition: int = param(kind="int", default=-1, minimum=-1, maximum=I32_MAX, invalid="invalid_partition",
                           doc="-1 or omitted: the broker chooses")


@dataclass(frozen=True)
class ReadArgs(Args):
    """CONSUME / STREAM topic= partition= [offset=] [batch=] [max_bytes=] [isolation=] [autoOffsetReset=]
    [group=] [member=] [wait_ms=] (``offset`` None = resume: committed offset, else the reset policy)."""

    topic: str = param(kind="custom", convert=read_topic_name, required=True)
    partition: int = param(kind="int", required=True, invalid="invalid_partition")
    isolation: str = param(kind="custom", convert=isolation, aliases=("isolation_level",),
                           default="read_committed")
    batch: int | None = param(kind="int", minimum=1, invalid="invalid_batch")
    max_bytes: int | None = param(kind="int", minimum=1, invalid="invalid_max_bytes")
    group: str | None = param()
    member: str | None = param()
    auto_offset_reset: str = param("autoOffsetReset", aliases=("auto_offset_reset",), default="earliest")
    offset: int | None = param(kind="int", minimum=0, invalid="invalid_offset")
    wait_ms: int = param(kind="int", default=0, minimum=0, invalid="invalid_wait_ms")


# ------------------------------------------------------------------------------------------- group commands


@dataclass(frozen=True)
class RegisterGroupArgs(Args):
    """REGISTER_GROUP group= (topic= | topics= | pattern=)."""

    group: str = param(kind="custom", convert=group_name, required=True)
    topic: str | None = param()
    topics: str | None = param()
    pattern: str | None = param()


@dataclass(frozen=True)
class MemberArgs(Args):
    """JOIN_GROUP / HEARTBEAT / LEAVE_GROUP [topic=] group= member= [generation=]."""

    group: str = param(kind="custom", convert=group_name, required=True)
    member: str = param(kind="custom", convert=member_id, required=True)
    topic: str | None = param(kind="custom", convert=topic_name)
    generation: int | None = param(kind="int", minimum=0, invalid="invalid_generation")


@dataclass(frozen=True)
class SyncGroupArgs(Args):
    """SYNC_GROUP [topic=] group= member= generation=."""

    group: str = param(kind="custom", convert=group_name, required=True)
    member: str = param(kind="custom", convert=member_id, required=True)
    topic: str | None = param(kind="custom", convert=topic_name)
    generation: int = param(kind="int", required=True, minimum=0, invalid="invalid_generation", default=0)


@dataclass(frozen=True)
class CommitOffsetArgs(Args):
    """COMMIT_OFFSET topic= partition= group= offset= member= generation= [validate_only=|ownership_only=]."""

    partition: int = param(kind="int", required=True, minimum=0, invalid="invalid_partition", default=0)
    offset: int = param(kind="int", required=True, minimum=0, invalid="invalid_offset", default=0)
    topic: str = param(kind="custom", convert=topic_name, required=True, default="")
    group: str = param(kind="custom", convert=group_name, required=True, default="")
    member: str = param(kind="custom", convert=member_id, required=True, default="")
    generation: int = param(kind="int", required=True, minimum=0, invalid="invalid_generation", default=0)
    validate_only: bool = param(kind="flag", aliases=("ownership_only",), default=False)


@dataclass(frozen=True)
class BatchCommitArgs(Args):
    """BATCH_COMMIT topic= group= member= generation= offsets=P<p>:<next>,... (or one positional list)."""

    topic: str = param(kind="custom", convert=topic_name, required=True, default="")
    group: str = param(kind="custom", convert=group_name, required=True, default="")
    member: str = param(kind="custom", convert=member_id, required=True, default="")
    generation: int = param(kind="int", required=True, minimum=0, invalid="invalid_generation", default=0)
    offsets: str | None = param(empty_ok=True, doc="P<partition>:<next offset>,...")
    positionals: tuple[str, ...] = ()


@dataclass(frozen=True)
class FetchOffsetArgs(Args):
    """FETCH_OFFSET topic= partition= group=."""

    topic: str = param(kind="custom", convert=topic_name, required=True, default="")
    partition: int = param(kind="int", required=True, minimum=0, invalid="invalid_partition", default=0)
    group: str = param(kind="custom", convert=group_name, required=True, default="")


@dataclass(frozen=True)
class GroupArgs(Args):
    """GROUP_STATUS group=."""

    group: str = param(kind="custom", convert=group_name, required=True)


@dataclass(frozen=True)
class FindCoordinatorArgs(Args):
    """FIND_COORDINATOR group= | transactional_id= (aliases txn=, transaction=)."""

    group: str | None = param()
    transactional_id: str | None = param(aliases=("txn", "transaction"))


# ------------------------------------------------------------------------------------- transaction commands


def transactional_id(raw: str, command: str) -> str:
    """`invalid_payload field=transactional_id` unless 1-249 printable characters without whitespace"""
    if len(raw) > 249 or any(c.isspace() or not c.isprintable() for c in raw):
        raise BrokerError.of("invalid_payload", command=command, field="transactional_id",
                             reason="1-249 printable characters without whitespace")
    return raw


def txn_result(raw: str, command: str) -> str:
    """`invalid_transaction_result` unless commit or abort"""
    if raw not in ("commit", "abort"):
        raise BrokerError.of("invalid_transaction_result", command=command, value=raw)
    return raw


def _txn_id_param() -> Any:
    return param(kind="custom", convert=transactional_id, required=True, missing="missing_transactional_id",
                 default="")


@dataclass(frozen=True)
class InitProducerIdArgs(Args):
    """INIT_PRODUCER_ID transactional_id= [producerId= epoch=]: with the caller's last session, the id is
    re-initialized only when that session is still its current one (else ``producer_fenced``)."""

    transactional_id: str = _txn_id_param()
    producer_id: str | None = param("producerId", aliases=("producer_id",),
                                    doc="with epoch: the caller's last session (guarded re-init)")
    epoch: int | None = param(kind="int", minimum=1, invalid="invalid_epoch",
                              doc="with producerId: the caller's last epoch")


@dataclass(frozen=True)
class TxnStatusArgs(Args):
    """TXN_STATUS transactional_id=."""

    transactional_id: str = _txn_id_param()


@dataclass(frozen=True)
class TxnSessionArgs(Args):
    """BEGIN_TXN transactional_id= producerId= epoch=."""

    transactional_id: str = _txn_id_param()
    producer_id: str = param("producerId", aliases=("producer_id",), required=True, missing="missing_producer_id",
                             default="")
    epoch: int = param(kind="int", required=True, minimum=0, invalid="invalid_epoch", missing="invalid_epoch",
                       default=0)


@dataclass(frozen=True)
class TxnPublishArgs(Args):
    """TXN_PUBLISH transactional_id= topic= [partition=] producerId= seqNum= epoch= [key=] message=."""

    transactional_id: str = _txn_id_param()
    topic: str = param(kind="custom", convert=topic_name, required=True, default="")
    partition: int = param(kind="int", default=-1, minimum=-1, maximum=I32_MAX, invalid="invalid_partition",
                           doc="-1 or omitted: the broker chooses")
    producer_id: str = param("producerId", aliases=("producer_id",), required=True, missing="missing_producer_id",
                             default="")
    seq_num: int = param("seqNum", aliases=("seq_num",), kind="int", required=True, minimum=1, maximum=U64_MAX,
                         invalid="invalid_seq_num", missing="invalid_seq_num", default=0,
                         doc="> 0; a retry with the same topic and seqNum appends nothing")
    epoch: int = param(kind="int", required=True, minimum=0, invalid="invalid_epoch", missing="invalid_epoch",
                       default=0)
    key: str | None = param(empty_ok=True)
    message: str = param(required=True, empty_ok=True, missing="missing_message", default="")


@dataclass(frozen=True)
class SendOffsetsArgs(Args):
    """SEND_OFFSETS_TO_TXN transactional_id= producerId= epoch= topic= group= member= generation=
    offsets=P<p>:<next>,..."""

    transactional_id: str = _txn_id_param()
    producer_id: str = param("producerId", aliases=("producer_id",), required=True, missing="missing_producer_id",
                             default="")
    epoch: int = param(kind="int", required=True, minimum=0, invalid="invalid_epoch", missing="invalid_epoch",
                       default=0)
    topic: str = param(kind="custom", convert=topic_name, required=True, default="")
    group: str = param(kind="custom", convert=group_name, required=True, default="")
    member: str = param(kind="custom", convert=member_id, required=True, default="")
    generation: int = param(kind="int", required=True, minimum=0, invalid="invalid_generation", default=0)
    offsets: str | None = param(empty_ok=True, doc="P<partition>:<next offset>,...")
    positionals: tuple[str, ...] = ()


@dataclass(frozen=True)
class EndTxnArgs(Args):
    """END_TXN transactional_id= producerId= epoch= result=commit|abort."""

    transactional_id: str = _txn_id_param()
    producer_id: str = param("producerId", aliases=("producer_id",), required=True, missing="missing_producer_id",
                             default="")
    epoch: int = param(kind="int", required=True, minimum=0, invalid="invalid_epoch", missing="invalid_epoch",
                       default=0)
    result: str = param(kind="custom", convert=txn_result, required=True, missing="invalid_transaction_result",
                        default="")


@dataclass(frozen=True)
class ElectLeaderArgs(Args):
    """ELECT_LEADER topic= partition= broker=<broker-id>."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    partition: int = param(kind="int", required=True, minimum=0, maximum=I32_MAX, invalid="invalid_partition")
    broker: str = param(required=True, doc="the target broker id")


# -------------------------------------------------------------------------------------------- event store

U32_MAX = (1 << 32) - 1


def from_version(raw: str, command: str) -> int:
    """`invalid_from_version` unless an integer >= 1"""

    value = parse_int(raw, minimum=1, maximum=U64_MAX)
    if value is None:
        raise BrokerError.of("invalid_from_version", command=command, value=raw)
    return value


@dataclass(frozen=True)
class AppendStreamArgs(Args):
    """APPEND_STREAM topic= key= version= [event_type=] [schema_version=] [metadata=] [event_id=]
    [producerId= seqNum= epoch=] message= (spec "APPEND_STREAM"; camelCase aliases, facts decision 8)."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    key: str = param(required=True)
    version: int = param(kind="int", required=True, minimum=1, maximum=I64_MAX,
                         aliases=("expectedVersion", "expected_version"),
                         doc="the version the new event takes: current + 1")
    event_type: str = param(aliases=("eventType",), default="", empty_ok=True)
    schema_version: int = param(kind="int", aliases=("schemaVersion",), default=1, minimum=0, maximum=U32_MAX,
                                invalid="invalid_schema_version")
    metadata: str = param(default="", empty_ok=True, doc="arbitrary JSON metadata")
    event_id: str = param(aliases=("eventId",), default="", doc="aggregate replay topics: required")
    producer_id: str = param("producerId", aliases=("producer_id",), default="")
    seq_num: int = param("seqNum", aliases=("seq_num",), kind="int", default=0, minimum=0, maximum=U64_MAX,
                         invalid="invalid_seq_num")
    epoch: int = param(kind="int", default=0, minimum=0, invalid="invalid_epoch", doc=">= 0 (a producer epoch)")
    message: str = param(required=True, empty_ok=True, missing="missing_message")


@dataclass(frozen=True)
class TxnAppendStreamArgs(Args):
    """TXN_APPEND_STREAM transactional_id= topic= key= expected_version= producerId= seqNum= epoch=
    [schema_version=] [event_type=] [metadata=] message= (facts A6 "Transactions"): APPEND_STREAM's
    fields plus the transaction session; seqNum as for TXN_PUBLISH (> 0, per topic)."""

    transactional_id: str = _txn_id_param()
    topic: str = param(kind="custom", convert=topic_name, required=True, default="")
    key: str = param(required=True, default="")
    version: int = param(kind="int", required=True, minimum=1, maximum=I64_MAX,
                         aliases=("expectedVersion", "expected_version"), default=0,
                         doc="the version the new event takes: current + 1 (the transaction's own staged "
                             "appends count)")
    producer_id: str = param("producerId", aliases=("producer_id",), required=True, missing="missing_producer_id",
                             default="")
    seq_num: int = param("seqNum", aliases=("seq_num",), kind="int", required=True, minimum=1, maximum=U64_MAX,
                         invalid="invalid_seq_num", missing="invalid_seq_num", default=0,
                         doc="> 0; a retry with the same topic and seqNum appends nothing")
    epoch: int = param(kind="int", required=True, minimum=0, invalid="invalid_epoch", missing="invalid_epoch",
                       default=0)
    event_type: str = param(aliases=("eventType",), default="", empty_ok=True)
    schema_version: int = param(kind="int", aliases=("schemaVersion",), default=1, minimum=0, maximum=U32_MAX,
                                invalid="invalid_schema_version")
    metadata: str = param(default="", empty_ok=True, doc="arbitrary JSON metadata")
    message: str = param(required=True, empty_ok=True, missing="missing_message", default="")


@dataclass(frozen=True)
class ReadStreamArgs(Args):
    """READ_STREAM topic= key= [from_version=] (two frames: JSON envelope, CBV2 batch)."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    key: str = param(required=True)
    from_version: int = param(kind="custom", convert=from_version, default=1, aliases=("fromVersion",),
                              doc="default 1; a usable snapshot advances the events to its version + 1")


@dataclass(frozen=True)
class StreamKeyArgs(Args):
    """STREAM_VERSION / READ_SNAPSHOT topic= key=."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    key: str = param(required=True)


@dataclass(frozen=True)
class SaveSnapshotArgs(Args):
    """SAVE_SNAPSHOT topic= key= version= message= (version at most the stream's current version)."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    key: str = param(required=True)
    version: int = param(kind="int", required=True, minimum=1, maximum=I64_MAX)
    message: str = param(required=True, empty_ok=True, missing="missing_message")


@dataclass(frozen=True)
class BrowseArgs(Args):
    """BROWSE_MESSAGES topic= [partition=] [offset=] [limit=] (cursusctl browse; committed records)."""

    topic: str = param(kind="custom", convert=read_topic_name, required=True)
    partition: int = param(kind="int", default=0, minimum=0, maximum=I32_MAX, invalid="invalid_partition")
    offset: int | None = param(kind="int", minimum=0, invalid="invalid_offset", doc="default: the log start")
    limit: int = param(kind="int", default=100, minimum=1, maximum=10_000, aliases=("batch", "max_records"),
                       invalid="invalid_limit")


@dataclass(frozen=True)
class ReplayProofArgs(Args):
    """AGGREGATE_REPLAY_PROOF topic= match_id= [partition=] [expected_last_sequence=]."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    match_id: str = param(aliases=("key", "matchId"), required=True)
    partition: int | None = param(kind="int", minimum=0, maximum=I32_MAX, invalid="invalid_partition",
                                  doc="default: the match id's partition")
    expected_last_sequence: int | None = param(kind="int", minimum=1, maximum=U64_MAX)


@dataclass(frozen=True)
class RangeReadArgs(Args):
    """AGGREGATE_EVENT_RANGE_READ topic= match_id= from_sequence= to_sequence= [max_records=]."""

    topic: str = param(kind="custom", convert=topic_name, required=True)
    match_id: str = param(aliases=("key", "matchId"), required=True)
    from_sequence: int = param(kind="int", required=True, minimum=1, maximum=U64_MAX)
    to_sequence: int = param(kind="int", required=True, minimum=1, maximum=U64_MAX)
    max_records: int = param(kind="int", default=1000, minimum=1, maximum=100_000)
    partition: int | None = param(kind="int", minimum=0, maximum=I32_MAX, invalid="invalid_partition")


ARGS: Mapping[Command, type[Args]] = {
    Command.AUTH: AuthArgs,
    Command.EXIT: NoArgs,
    Command.HELP: NoArgs,
    Command.CREATE: TopicSpec,
    Command.LIST: NoArgs,
    Command.DESCRIBE: TopicArgs,
    Command.ALTER_TOPIC_CONFIG: AlterTopicConfigArgs,
    Command.DELETE: DeleteArgs,
    Command.TRUNCATE: TruncateArgs,
    Command.METADATA: TopicArgs,
    Command.LIST_OFFSETS: ListOffsetsArgs,
    Command.PUBLISH: PublishArgs,
    Command.CONSUME: ReadArgs,
    Command.STREAM: ReadArgs,
    Command.REGISTER_GROUP: RegisterGroupArgs,
    Command.JOIN_GROUP: MemberArgs,
    Command.SYNC_GROUP: SyncGroupArgs,
    Command.HEARTBEAT: MemberArgs,
    Command.LEAVE_GROUP: MemberArgs,
    Command.COMMIT_OFFSET: CommitOffsetArgs,
    Command.BATCH_COMMIT: BatchCommitArgs,
    Command.FETCH_OFFSET: FetchOffsetArgs,
    Command.GROUP_STATUS: GroupArgs,
    Command.LIST_GROUPS: NoArgs,
    Command.FIND_COORDINATOR: FindCoordinatorArgs,
    Command.CLUSTER_STATUS: NoArgs,
    Command.LIST_CLUSTER: NoArgs,
    Command.ELECT_LEADER: ElectLeaderArgs,
    Command.INIT_PRODUCER_ID: InitProducerIdArgs,
    Command.BEGIN_TXN: TxnSessionArgs,
    Command.TXN_PUBLISH: TxnPublishArgs,
    Command.SEND_OFFSETS_TO_TXN: SendOffsetsArgs,
    Command.END_TXN: EndTxnArgs,
    Command.TXN_STATUS: TxnStatusArgs,
    Command.APPEND_STREAM: AppendStreamArgs,
    Command.TXN_APPEND_STREAM: TxnAppendStreamArgs,
    Command.READ_STREAM: ReadStreamArgs,
    Command.STREAM_VERSION: StreamKeyArgs,
    Command.SAVE_SNAPSHOT: SaveSnapshotArgs,
    Command.READ_SNAPSHOT: StreamKeyArgs,
    Command.BROWSE_MESSAGES: BrowseArgs,
    Command.AGGREGATE_REPLAY_PROOF: ReplayProofArgs,
    Command.AGGREGATE_EVENT_RANGE_READ: RangeReadArgs,
}


def _permissions_line(command: Command) -> str:
    """The permission-table line of a command's section (:data:`cursus.broker.auth.COMMAND_PERMISSIONS`)."""
    from cursus.broker.auth import COMMAND_PERMISSIONS, TRANSACTION

    required = COMMAND_PERMISSIONS.get(command)
    if not required:
        return "Permissions (enable_sasl=true): none, no authentication needed.\n"
    line = "Permissions (enable_sasl=true): " + " + ".join(f"`{p}`" for p in required)
    if command is Command.FIND_COORDINATOR:
        line += f" (`{TRANSACTION}` with `transactional_id=`)"
    return line + ".\n"


def render_markdown() -> str:
    """The command reference page (``docs/commands.md``) from :data:`ARGS`: one section per command with
    its parameters in validation order."""
    out = [
        "# Commands and their parameters\n",
        "Generated from `cursus/broker/args.py` (`python -m cursus.broker.args > docs/commands.md`); a test",
        "fails when this page and the code disagree. Parameters are validated in the order listed, so a request",
        "gets the first error in this order. Every command also accepts `principal=` and `auth_token=` (inline",
        "authentication). With `enable_sasl=true` a command needs every permission listed (docs/security.md).\n",
    ]
    for command in sorted(ARGS):
        args_type = ARGS[command]
        out.append(f"## {command.name} (id {int(command)})\n")
        out.append((args_type.__doc__ or "").strip().splitlines()[0] + "\n")
        out.append(_permissions_line(command))
        pairs = params_of(args_type)
        if not pairs:
            out.append("No parameters.\n")
            continue
        if args_type.STRICT:
            out.append("Unknown fields are refused with `invalid_field`.\n")
        out += ["| field | type | required | default | aliases | error when malformed | notes |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for attr, p in pairs:
            default = next(f.default for f in dataclasses.fields(args_type) if f.name == attr)  # type: ignore[arg-type]
            kind = "|".join(p.choices) if p.kind == "choice" else p.kind
            if p.kind == "custom":
                kind, invalid = "text", (p.convert.__doc__ or "").strip().splitlines()[0] if p.convert else ""
            elif p.kind in ("flag", "csv", "str"):
                invalid = "never"
            else:
                invalid = f"`{p.invalid or 'invalid_' + p.name}`"
            out.append(
                f"| `{p.name}` | {kind} | {'yes: `' + (p.missing or 'missing_' + p.name) + '`' if p.required else 'no'}"
                f" | {'' if p.required or default is None else '`' + str(default) + '`'}"
                f" | {', '.join('`' + a + '`' for a in p.aliases)} | {invalid} | {p.doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":  # python -m cursus.broker.args > docs/commands.md
    print(render_markdown(), end="")
