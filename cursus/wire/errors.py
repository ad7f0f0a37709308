"""Protocol failures and typed broker errors (facts A7, B4; spec section 7).

Two unrelated things called "error" live here:

* ``ProtocolError`` and its subclasses: the bytes on the wire are not valid Wire v2. Each
  carries ``.reason``, one of ``PROTOCOL_FAILURE_REASONS`` (the label set of the metric
  ``cursus_wire_protocol_failures_total{reason}``, facts B9). Decoders raise the specific
  subclasses; encoders raise ``LocalProtocolError`` when asked to emit something the
  protocol forbids (a programmer error on our side, h11 style).
* ``TypedError``: an application-level ERROR reply (status 2) with code, class, retryable
  flag, message and fields, its binary payload codec, its text rendering, and the
  code -> (class, retryable) ``REGISTRY``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from types import MappingProxyType

from cursus.limits import ERROR_FIELDS_COUNT_MAX

PROTOCOL_FAILURE_REASONS: tuple[str, ...] = (
    "invalid_frame",
    "frame_too_large",
    "checksum_mismatch",
    "compression_mismatch",
    "decompression_rejected",
    "unknown",
)


class ProtocolError(Exception):
    """Bytes that are not valid Wire v2 (facts B1.1, decision 5).

    ``reason`` is one of ``PROTOCOL_FAILURE_REASONS``; it is a class attribute on each
    subclass and may be overridden per instance with the ``reason=`` keyword. The broker
    closes the connection on any ``ProtocolError`` and counts it by ``reason``.
    """

    reason: str = "unknown"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            if reason not in PROTOCOL_FAILURE_REASONS:
                raise AssertionError(f"unknown protocol failure reason {reason!r}")
            self.reason = reason


class InvalidFrame(ProtocolError):
    """Malformed header, payload schema (negotiation, CRQ2, CBV2, typed error) or value."""

    reason = "invalid_frame"


class FrameTooLarge(ProtocolError):
    """A header length field exceeds the payload limit (64 MiB, or 1 KiB for negotiation)."""

    reason = "frame_too_large"


class ChecksumMismatch(ProtocolError):
    """The CRC-32C of the encoded payload does not match the header (facts A2)."""

    reason = "checksum_mismatch"


class CompressionMismatch(ProtocolError):
    """The frame's compression flags differ from the negotiated compression (facts B1.1)."""

    reason = "compression_mismatch"


class DecompressionRejected(ProtocolError):
    """The payload did not decompress to exactly the header's decoded length (decision 3)."""

    reason = "decompression_rejected"


class LocalProtocolError(ProtocolError):
    """We were asked to *encode* something the protocol forbids (a caller bug).

    Raised by every ``encode_*`` function instead of producing bytes a peer would reject.
    ``reason`` is ``invalid_frame`` unless the caller passes another (``frame_too_large``
    for payloads over the limit).
    """

    reason = "invalid_frame"


class ErrorClass(IntEnum):
    """Typed error class ids (facts A7, B4.1). ``label`` is the rendered lower-case name."""

    VALIDATION = 1
    AUTHORIZATION = 2
    ROUTING = 3
    AVAILABILITY = 4
    CONFLICT = 5
    FENCING = 6
    NOT_FOUND = 7
    INTERNAL = 8

    @property
    def label(self) -> str:
        """The name used in rendered text: ``validation``, ``not_found``, ..."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> ErrorClass | None:
        """The class named ``label`` (case-insensitive), or None when there is none."""
        member = cls.__members__.get(label.strip().upper())
        return member


# The registry as data: (class, retryable, codes). Sources, in order: facts B4.3 base list
# including its † and ‡ branch variants; the B4.3 cluster-server codes; codes the spec
# (sections 5, 7, 8 and the topic commands) emits; codes our broker adds. Codes that the
# reference resolves by the fallback rules keep the fallback's class here so that our
# replies classify exactly like the reference broker's.
_REGISTRY_TABLE: tuple[tuple[ErrorClass, bool, tuple[str, ...]], ...] = (
    (ErrorClass.ROUTING, True, ("NOT_COORDINATOR", "NOT_LEADER", "NOT_PARTITION_LEADER")),
    (
        ErrorClass.AVAILABILITY,
        True,
        (
            "cluster_metadata_unavailable", "cluster_not_available", "coordinator_not_available",
            "fsm_not_available", "insufficient_in_sync_replicas", "leader_election_result_unavailable",
            "leader_not_found", "no_raft_leader", "offset_manager_not_available", "request_cancelled",
            "router_not_available", "transaction_abort_marker_failed", "transaction_commit_failed",
            "transaction_manager_not_available", "transaction_offset_materialization_failed",
            "transaction_offset_prepare_failed", "transaction_sync_failed",
            # conformance vector structured_availability_error
            "replication_unavailable",
            # spec: aggregate replay proof could not be computed right now
            "aggregate_proof_proof_unavailable",
            # our broker: connection/resource limits are temporary
            "too_many_connections", "resource_exhausted", "leader_not_available",
        ),
    ),
    (
        # Our broker: after an fsync failure the partition is fenced until restart, so
        # retrying against this broker cannot help (Kafka's KafkaStorageException stance).
        ErrorClass.AVAILABILITY,
        False,
        ("partition_fenced", "storage_unavailable",
         # a stored chunk failed its checksum: the broker refuses to serve it; an operator must repair
         "corrupt_log_data"),
    ),
    (
        ErrorClass.FENCING,
        False,
        (
            "GEN_MISMATCH", "member_not_found", "NOT_OWNER", "producer_fenced", "STALE_LEADER_EPOCH",
            "stale_producer_epoch",
            # spec section 7
            "PARTITION_LEADER_FENCED",
        ),
    ),
    (
        ErrorClass.CONFLICT,
        False,
        (
            "leader_election_rejected", "OFFSET_OUT_OF_RANGE", "offset_regression",
            "producer_reinitialization_required", "snapshot_version_exceeds_stream",
            "topic_not_assigned_to_group", "transaction_aborted", "transaction_already_committed",
            "transaction_marker_partition_not_touched", "transaction_not_abortable",
            "transaction_not_committing", "transaction_record_not_staged", "version_conflict",
            # spec: aggregate replay proof failures
            "aggregate_proof_retention_gap", "aggregate_proof_sequence_gap",
            "aggregate_proof_identity_conflict",
            # our broker: Kafka's OutOfOrderSequence is a non-retryable conflict
            "idempotency_gap", "sequence_out_of_order",
            # our broker: READ_STREAM of events no longer in the log (below its start, no snapshot covers them)
            "stream_retention_gap",
        ),
    ),
    (
        ErrorClass.AUTHORIZATION,
        False,
        (
            "authentication_failed", "authentication_required", "internal_auth_not_configured",
            "internal_batch_requires_token_wrapper", "internal_command_unauthorized",
            "internal_topic_write_forbidden", "internal_txn_publish_forbidden",
            "NOT_AUTHORIZED_FOR_OPERATION", "NOT_AUTHORIZED_FOR_PARTITION", "NOT_AUTHORIZED_FOR_TOPIC",
            "transaction_metadata_forbidden",
            # B4.3 cluster server
            "cluster_unauthorized",
            # facts A7: spellings the clients map to authentication/authorization errors
            "AUTHENTICATION_REQUIRED", "authorization_denied", "AUTHORIZATION_DENIED",
        ),
    ),
    (
        ErrorClass.NOT_FOUND,
        False,
        (
            "group_not_found", "partition_metadata_not_found", "partition_not_found", "topic_not_found",
            "transaction_not_found",
            # spec section 7 upper-case variants
            "PARTITION_NOT_FOUND", "TOPIC_NOT_FOUND",
        ),
    ),
    (
        ErrorClass.VALIDATION,
        False,
        (
            "batch_decode_failed", "consumer_group_subscriptions_feature_required", "decode_failed",
            "distribution_not_enabled", "distribution_required", "duplicate_partition", "empty_command",
            "empty_messages", "empty_required_params", "event_sourcing_not_enabled", "group_epoch_mismatch",
            "invalid_acks", "invalid_auth", "invalid_batch_commit_entry", "invalid_batch_commit_format",
            "invalid_commit_watermark", "invalid_consume_syntax", "invalid_control_batch_bytes",
            "invalid_control_batch_coordinator_epoch", "invalid_control_batch_version", "invalid_epoch",
            "invalid_from_version", "invalid_generation", "invalid_group_epoch", "invalid_is_idempotent",
            "invalid_min_in_sync_replicas", "invalid_offset", "invalid_partition", "invalid_partitions",
            "invalid_payload", "invalid_payload_json", "invalid_protocol_features",
            "invalid_protocol_version", "invalid_replication_factor", "invalid_require_features",
            "invalid_retention_bytes", "invalid_retention_hours", "invalid_schema_version",
            "invalid_seq_num", "invalid_snapshot_catchup_response", "invalid_snapshot_payload",
            "invalid_stream_syntax", "invalid_subscription", "invalid_topic_name", "invalid_topic_policy",
            "invalid_transaction_control_batch", "invalid_transaction_control_epoch",
            "invalid_transaction_control_record", "invalid_transaction_marker",
            "invalid_transaction_marker_producer", "invalid_transaction_result",
            "invalid_transaction_state", "invalid_txn_offsets", "invalid_version", "malformed_input",
            "missing_broker", "missing_coordinator_key", "missing_generation", "missing_group",
            "missing_key", "missing_leader_fence", "missing_member", "missing_message",
            "missing_min_in_sync_replicas", "missing_offset", "missing_ownership_params",
            "missing_partition", "missing_payload", "missing_producer_id", "missing_protocol_version",
            "missing_required_params", "missing_topic", "missing_transactional_id", "missing_version",
            "no_valid_offsets", "transaction_not_open", "transactional_processing_feature_required",
            "unknown_command", "unmarshal_failed", "UNSUPPORTED_FEATURE", "UNSUPPORTED_PROTOCOL_VERSION",
            "unsupported_topic_policy",
            # B4.3 cluster server
            "invalid_cluster_request", "unsupported_cluster_command",
            # spec topic commands; B4.3 says the reference resolves these by fallback
            "invalid_if_exists", "invalid_idempotent", "invalid_event_sourcing",
            # our broker (invalid_field: an unknown field on CREATE/ALTER_TOPIC_CONFIG, decision 8)
            "message_too_large", "invalid_isolation", "invalid_batch", "invalid_wait_ms",
            "invalid_max_bytes", "invalid_field",
            # our broker: TXN_APPEND_STREAM on an aggregate-replay topic
            "transactional_append_unsupported",
            # our broker: a transaction whose coordinator state would exceed transaction_state_max_bytes
            "transaction_too_large",
            # our broker: event-store arguments (cursus.broker.args)
            "invalid_limit", "invalid_expected_last_sequence", "invalid_from_sequence", "invalid_to_sequence",
            "invalid_max_records", "missing_event_id", "missing_match_id", "missing_from_sequence",
            "missing_to_sequence",
            # our broker: TRUNCATE's required compare-and-set revision
            "invalid_expected_revision", "missing_expected_revision",
        ),
    ),
    (
        ErrorClass.INTERNAL,
        False,
        (
            "alter_topic_config_failed", "append_stream_failed", "broker_error", "command_failed",
            "coordinator_error", "create_topic_failed", "delete_topic_failed", "empty_command_response",
            "find_coordinator_failed", "forward_to_coordinator_failed", "forward_to_leader_failed",
            "forward_to_partition_leader_failed", "group_status_failed", "init_producer_failed",
            "local_processor_not_configured", "marshal_ack_failed", "marshal_brokers_failed",
            "marshal_cluster_status_failed", "marshal_metadata_failed", "marshal_snapshot_failed",
            "marshal_snapshots_failed", "marshal_status_failed", "negotiation_context_required",
            "no_partitions_available", "offset_sync_failed", "partition_lookup_failed",
            "raft_apply_failed", "raft_batch_apply_failed", "register_group_failed",
            "replica_append_failed", "replica_index_failed", "replica_index_prepare_failed",
            "snapshot_catchup_failed", "snapshot_list_failed", "snapshot_read_failed",
            "snapshot_replicate_failed", "snapshot_save_failed", "snapshot_store_failed",
            "stream_index_failed", "topic_create_missing", "transaction_abort_failed",
            "transaction_begin_failed", "transaction_offsets_failed", "transaction_prepare_failed",
            "transaction_publish_failed",
            # B4.3 cluster server
            "cluster_join_failed",
            # spec codes the reference classifies by fallback (internal)
            "request_timeout", "topic_delete_blocked", "topic_truncate_blocked",
            "internal_topic_delete_forbidden",
            # our broker: TRUNCATE's metadata commit failed (nothing changed), as delete_topic_failed
            "truncate_topic_failed",
        ),
    ),
)


def _build_registry() -> Mapping[str, tuple[ErrorClass, bool]]:
    table: dict[str, tuple[ErrorClass, bool]] = {}
    for error_class, retryable, codes in _REGISTRY_TABLE:
        for code in codes:
            if code in table:
                raise AssertionError(f"error code {code!r} registered twice")
            table[code] = (error_class, retryable)
    return MappingProxyType(table)


REGISTRY: Mapping[str, tuple[ErrorClass, bool]] = _build_registry()
"""code -> (class, retryable) for every code the broker may emit (facts B4.3, spec s7)."""

_VALIDATION_PREFIXES = ("missing_", "invalid_", "empty_", "malformed_", "decode_", "unmarshal_")
_VALIDATION_EXACT = frozenset({"unknown_command", "distribution_required", "distribution_not_enabled"})


def classify(code: str) -> tuple[ErrorClass, bool]:
    """Return (class, retryable) for ``code`` (facts B4.3).

    The registry wins; an unregistered code is classified by the B4.3 fallback rules on
    its lower-cased form (always retryable=False): ``not_authorized``/``authorization_``
    prefix -> authorization; ``_not_found``/``_missing`` suffix -> not_found; validation
    prefixes or the exact codes unknown_command/distribution_* -> validation; else internal.
    Never raises.
    """
    known = REGISTRY.get(code)
    if known is not None:
        return known
    lowered = code.lower()
    if lowered.startswith(("not_authorized", "authorization_")):
        return ErrorClass.AUTHORIZATION, False
    if lowered.endswith(("_not_found", "_missing")):
        return ErrorClass.NOT_FOUND, False
    if lowered.startswith(_VALIDATION_PREFIXES) or lowered in _VALIDATION_EXACT:
        return ErrorClass.VALIDATION, False
    return ErrorClass.INTERNAL, False


_NEEDS_QUOTING = re.compile(r'[\s"]')


def _render_value(value: str) -> str:
    # Values with whitespace or a double quote are JSON-quoted so that the client's
    # shell-style splitter keeps them in one token (facts A7, B4.2).
    if value == "" or _NEEDS_QUOTING.search(value) is None:
        return value
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class TypedError:
    """An ERROR-status reply (facts A7, B4.1).

    ``code`` is non-empty; ``fields`` maps non-empty keys to values (at most 256). Build
    one with ``make_error`` so class and retryable come from the registry.
    """

    code: str
    error_class: ErrorClass
    retryable: bool
    message: str = ""
    fields: Mapping[str, str] = field(default_factory=dict)

    def render(self) -> str:
        """The client's text form (facts A7, B4.2).

        ``ERROR: <code> class=<label> retryable=<true|false> k=v ... <message>`` with keys
        sorted and values containing whitespace or ``"`` JSON-quoted. The message, when
        non-empty, comes last and unquoted.
        """
        parts = [
            "ERROR:",
            self.code,
            f"class={ErrorClass(self.error_class).label}",
            f"retryable={'true' if self.retryable else 'false'}",
        ]
        parts.extend(f"{key}={_render_value(self.fields[key])}" for key in sorted(self.fields))
        if self.message:
            parts.append(self.message)
        return " ".join(parts)


def _field_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def make_error(code: str, message: str = "", /, **fields: object) -> TypedError:
    """Build a ``TypedError`` whose class and retryable flag come from ``classify(code)``.

    Field values are converted with ``str()`` (bools as ``true``/``false``); ``None``
    values are dropped. Raises ``LocalProtocolError`` for an empty code.
    """
    if not code:
        raise LocalProtocolError("typed error code must be non-empty")
    error_class, retryable = classify(code)
    clean = {key: _field_text(value) for key, value in fields.items() if value is not None}
    return TypedError(code, error_class, retryable, message, clean)


class BrokerError(Exception):
    """An exception carrying a ``TypedError`` (``.error``); broker handlers raise it.

    ``BrokerError(typed_error)`` wraps an existing error; ``BrokerError(code, message,
    **fields)`` and ``BrokerError.of(code, message, **fields)`` build one with
    ``make_error``, e.g. ``raise BrokerError.of("topic_not_found", topic=name)``.

    Registry contract: ``tests/unit/test_wire_errors.py`` scans every ``.py`` file under
    ``cursus/`` for a string literal passed as the first argument of ``make_error(``,
    ``BrokerError.of(``, ``BrokerError(`` or ``TypedError(`` and fails when that code is
    not in ``REGISTRY``. So pass codes as literals to these constructors, and register
    new codes in ``_REGISTRY_TABLE`` first.
    """

    def __init__(self, error: TypedError | str, message: str = "", /, **fields: object) -> None:
        if isinstance(error, str):
            error = make_error(error, message, **fields)
        elif message or fields:
            raise TypeError("BrokerError(TypedError) takes no message or fields")
        super().__init__(error.render())
        self.error: TypedError = error

    @classmethod
    def of(cls, code: str, message: str = "", /, **fields: object) -> BrokerError:
        """``BrokerError(make_error(code, message, **fields))``."""
        return cls(make_error(code, message, **fields))


_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")


def _encode_string(value: str, what: str) -> bytes:
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"{what} is not encodable as UTF-8") from exc
    return _U32.pack(len(raw)) + raw


def encode_error(err: TypedError) -> bytes:
    """Encode the typed error payload (facts A7, B4.1).

    Layout: code string, u8 class, u8 retryable, message string, u16 field count, then
    (key string, value string) sorted by key; strings are u32 length + UTF-8. Raises
    ``LocalProtocolError`` for an empty code, an unknown class, more than 256 fields or
    an empty key.
    """
    if not err.code:
        raise LocalProtocolError("typed error code must be non-empty")
    try:
        error_class = ErrorClass(err.error_class)
    except ValueError as exc:
        raise LocalProtocolError(f"unknown error class {err.error_class!r}") from exc
    if len(err.fields) > ERROR_FIELDS_COUNT_MAX:
        raise LocalProtocolError(f"typed error has {len(err.fields)} fields (max {ERROR_FIELDS_COUNT_MAX})")
    parts = [
        _encode_string(err.code, "error code"),
        bytes((error_class, 1 if err.retryable else 0)),
        _encode_string(err.message, "error message"),
        _U16.pack(len(err.fields)),
    ]
    for key in sorted(err.fields):
        if not key:
            raise LocalProtocolError("typed error field keys must be non-empty")
        parts.append(_encode_string(key, "error field key"))
        parts.append(_encode_string(err.fields[key], "error field value"))
    return b"".join(parts)


def _read_string(data: bytes, pos: int, what: str) -> tuple[str, int]:
    if pos + 4 > len(data):
        raise InvalidFrame(f"typed error truncated before {what} length")
    (length,) = _U32.unpack_from(data, pos)
    pos += 4
    end = pos + length
    if end > len(data):
        raise InvalidFrame(f"typed error {what} length {length} exceeds payload")
    try:
        return data[pos:end].decode("utf-8"), end
    except UnicodeDecodeError as exc:
        raise InvalidFrame(f"typed error {what} is not valid UTF-8") from exc


def decode_error(payload: bytes | memoryview) -> TypedError:
    """Decode a typed error payload strictly (facts A7, B4.1).

    Raises ``InvalidFrame`` for: empty code, class outside 1-8, retryable > 1, more than
    256 fields, empty or duplicate keys, invalid UTF-8, truncation or trailing bytes.
    Field order in the result is the wire order.
    """
    data = bytes(payload)
    code, pos = _read_string(data, 0, "code")
    if not code:
        raise InvalidFrame("typed error code is empty")
    if pos + 2 > len(data):
        raise InvalidFrame("typed error truncated before class/retryable")
    class_id, retryable = data[pos], data[pos + 1]
    pos += 2
    if not 1 <= class_id <= 8:
        raise InvalidFrame(f"typed error class {class_id} is not 1-8")
    if retryable > 1:
        raise InvalidFrame(f"typed error retryable byte {retryable} is not 0 or 1")
    message, pos = _read_string(data, pos, "message")
    if pos + 2 > len(data):
        raise InvalidFrame("typed error truncated before field count")
    (count,) = _U16.unpack_from(data, pos)
    pos += 2
    if count > ERROR_FIELDS_COUNT_MAX:
        raise InvalidFrame(f"typed error has {count} fields (max {ERROR_FIELDS_COUNT_MAX})")
    fields: dict[str, str] = {}
    for _ in range(count):
        key, pos = _read_string(data, pos, "field key")
        value, pos = _read_string(data, pos, "field value")
        if not key:
            raise InvalidFrame("typed error field key is empty")
        if key in fields:
            raise InvalidFrame(f"typed error field {key!r} repeated")
        fields[key] = value
    if pos != len(data):
        raise InvalidFrame(f"typed error has {len(data) - pos} trailing bytes")
    return TypedError(code, ErrorClass(class_id), retryable == 1, message, fields)


def _split_error_tokens(text: str) -> list[str]:
    """Split on whitespace except inside double quotes; backslash escapes inside quotes."""
    tokens: list[str] = []
    current: list[str] = []
    in_quotes = False
    escaped = False
    started = False
    for ch in text:
        if in_quotes:
            current.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_quotes = False
        elif ch.isspace():
            if started:
                tokens.append("".join(current))
                current = []
                started = False
        else:
            current.append(ch)
            started = True
            if ch == '"':
                in_quotes = True
    if started:
        tokens.append("".join(current))
    return tokens


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        try:
            result = json.loads(value)
        except ValueError:
            return value[1:-1]
        if isinstance(result, str):
            return result
    return value


def parse_error_text(text: str) -> TypedError:
    """Convert a handler's ``ERROR: <code> tok k=v k="quoted v" ...`` text (facts B4.2).

    The ``ERROR:`` (or ``ERROR``) prefix is optional. Tokens split on whitespace except
    inside double quotes. ``k=v`` tokens (non-empty k) become fields, quoted values are
    unquoted; other tokens are message words joined by single spaces. Valid ``class=``
    and ``retryable=`` tokens override the registry and are not kept as fields. A text
    without a code yields ``broker_error``. Never raises.
    """
    body = text.strip()
    if body.startswith("ERROR:"):
        body = body[len("ERROR:"):]
    elif body.startswith("ERROR ") or body == "ERROR":
        body = body[len("ERROR"):]
    tokens = _split_error_tokens(body)
    code = tokens[0] if tokens else "broker_error"
    error_class, retryable = classify(code)
    words: list[str] = []
    fields: dict[str, str] = {}
    for token in tokens[1:]:
        key, sep, raw_value = token.partition("=")
        if not sep or not key:
            words.append(token)
            continue
        value = _unquote(raw_value)
        if key == "class":
            override = ErrorClass.from_label(value)
            if override is not None:
                error_class = override
                continue
        if key == "retryable" and value.lower() in ("true", "false"):
            retryable = value.lower() == "true"
            continue
        fields[key] = value
    return TypedError(code, error_class, retryable, " ".join(words), fields)
