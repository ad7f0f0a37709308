"""``MetadataFSM``: the Raft state machine of the cluster metadata.

It applies exactly the :mod:`cursus.metadata.commands` bytes the standalone backend applies, with the same
pure :func:`cursus.metadata.apply.apply`, so both backends reach the same state from the same commands.
Runs on the Raft tick thread (:class:`~cursus.cluster.raft.node.RaftNode`): ``apply`` is pure CPU work on
immutable values and never blocks; every applied state is handed to ``on_change`` (which must only
schedule work elsewhere, e.g. ``loop.call_soon_threadsafe``).

Results are JSON bytes: ``{"ok": <ApplyResult>}`` or ``{"error": {"code", "message", "fields"}}`` (a
rejected command changes nothing and is answered with its typed error on the submitting broker). The
snapshot is :func:`cursus.metadata.snapshot.encode_state` (consumer groups and committed offsets included);
a partition without committed-HWM provenance, or a v1 state whose groups lived in ``__consumer_offsets``,
refuses the restore with ``unsupported recovery protocol``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cursus.cluster.raft.errors import UnsupportedRecoveryProtocol
from cursus.metadata.apply import ApplyResult, apply
from cursus.metadata.commands import Command, decode
from cursus.metadata.snapshot import (
    MissingProvenance,
    UnsupportedGroupState,
    decode_state,
    encode_state,
    result_from_dict,
    result_to_dict,
)
from cursus.metadata.state import MetadataState
from cursus.wire.errors import BrokerError, make_error

#: ``on_change(state, command, result)``: the state after one applied command (command and result None
#: after a snapshot restore). Called on the tick thread.
OnChange = Callable[[MetadataState, Command | None, ApplyResult | None], None]


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def error_result(error: BrokerError) -> bytes:
    e = error.error
    return _dump({"error": {"code": e.code, "message": e.message, "fields": dict(e.fields)}})


def decode_result(data: bytes) -> ApplyResult:
    """The :class:`ApplyResult` in FSM result bytes.

    Raises:
        BrokerError: the command was rejected (its typed error), or the bytes are not a result
            (``raft_apply_failed``).
    """
    try:
        doc = json.loads(data)
        if "error" in doc:
            err = doc["error"]
            raise BrokerError(make_error(err["code"], err["message"], **err["fields"]))
        return result_from_dict(doc["ok"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BrokerError.of("raft_apply_failed", reason=f"bad FSM result: {exc!r}") from None


class MetadataFSM:
    """Metadata state replicated by Raft (see the module docstring).

    Args:
        initial: the state before any command (a cluster state: ``cluster=True``, leader epochs from 1).
        on_change: see :data:`OnChange`.
    """

    def __init__(self, initial: MetadataState, on_change: OnChange | None = None) -> None:
        self._initial = initial
        self.state = initial
        self.on_change = on_change

    def apply(self, command: bytes) -> bytes:
        try:
            decoded = decode(command)
        except ValueError as exc:
            return error_result(BrokerError.of("invalid_cluster_request", reason=str(exc)))
        try:
            self.state, result = apply(self.state, decoded)
        except BrokerError as exc:
            return error_result(exc)
        if self.on_change is not None:
            self.on_change(self.state, decoded, result)
        return _dump({"ok": result_to_dict(result)})

    def snapshot(self) -> bytes:
        return encode_state(self.state)

    def restore(self, data: bytes) -> None:
        try:
            state = decode_state(data)
        except (MissingProvenance, UnsupportedGroupState) as exc:
            raise UnsupportedRecoveryProtocol(f"metadata snapshot: {exc}") from None
        except ValueError as exc:
            raise UnsupportedRecoveryProtocol(f"metadata snapshot unreadable: {exc}") from None
        self.state = state
        if self.on_change is not None:
            self.on_change(state, None, None)
