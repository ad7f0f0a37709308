"""Errors of the Raft layer. ``code`` names the wire error code (cursus/wire/errors.py) to answer with."""

from __future__ import annotations


class RaftError(Exception):
    """Base class; ``code`` is the wire error code a handler should reply with."""

    code = "raft_apply_failed"


class CommandTooLarge(RaftError):
    """The command exceeds :data:`cursus.cluster.raft.commands.MAX_COMMAND_BYTES`; nothing was submitted."""

    code = "message_too_large"


class RaftUnavailable(RaftError):
    """The command was definitely not applied (no leader, queue full, node stopped); safe to retry."""

    code = "no_raft_leader"


class UnknownOutcome(RaftError):
    """The command may or may not be applied (timeout, leader change). Retry with the same request id:
    the FSM applies a request id at most once."""

    code = "request_timeout"

    def __init__(self, message: str, request_id: bytes) -> None:
        super().__init__(message)
        self.request_id = request_id


class RaftFatal(RaftError):
    """The node stopped itself (an fsync/write failed, a snapshot could not be loaded, a safety check
    fired). Its on-disk state is intact up to the last sync; restart the process."""


class UnsupportedRecoveryProtocol(RuntimeError):
    """The Raft directory holds state this version cannot recover; startup is refused."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"unsupported recovery protocol: {detail}; recovery is a clean bootstrap of the whole "
            "cluster (stop every node, empty every Raft directory, start again)")


class PysyncobjVersionError(RuntimeError):
    """The installed pysyncobj is not the version the compatibility layer was checked against."""
