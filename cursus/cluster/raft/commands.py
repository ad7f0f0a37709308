"""The replicated command envelope and the request-id dedup table (both deterministic bytes).

Every Raft log entry our layer writes is ``ENVELOPE_VERSION (1 byte) | request id (16 bytes) | body``;
the body is the FSM's own versioned, deterministic command. A request id is applied at most once: the
:class:`DedupTable` remembers the result of the last ``capacity`` request ids (evicting in apply order,
so every node evicts the same ids) and is part of each snapshot.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

from cursus.cluster.raft.errors import CommandTooLarge

ENVELOPE_VERSION = 1
REQUEST_ID_BYTES = 16
#: Largest Raft entry we write (type byte + envelope + body); pysyncobj splits larger ones, which breaks.
MAX_ENTRY_BYTES = 64 * 1024
#: Largest FSM command body accepted by :func:`encode_command`.
MAX_COMMAND_BYTES = MAX_ENTRY_BYTES - 1 - 1 - REQUEST_ID_BYTES
DEFAULT_DEDUP_CAPACITY = 10_000

_COUNT = struct.Struct("<I")


def encode_command(request_id: bytes, body: bytes) -> bytes:
    """The envelope bytes for ``body``.

    Raises:
        CommandTooLarge: ``body`` is longer than :data:`MAX_COMMAND_BYTES`.
        ValueError: ``request_id`` is not 16 bytes.
    """
    if len(request_id) != REQUEST_ID_BYTES:
        raise ValueError("request id must be 16 bytes")
    if len(body) > MAX_COMMAND_BYTES:
        raise CommandTooLarge(f"command of {len(body)} bytes exceeds {MAX_COMMAND_BYTES}")
    return bytes((ENVELOPE_VERSION,)) + request_id + body


def decode_command(payload: bytes) -> tuple[bytes, bytes]:
    """``(request_id, body)`` of an envelope.

    Raises:
        ValueError: unknown envelope version or truncated envelope.
    """
    if len(payload) < 1 + REQUEST_ID_BYTES or payload[0] != ENVELOPE_VERSION:
        raise ValueError("unknown command envelope")
    return payload[1:1 + REQUEST_ID_BYTES], payload[1 + REQUEST_ID_BYTES:]


class DedupTable:
    """request id -> result bytes of the last ``capacity`` applied commands, evicted in apply order."""

    def __init__(self, capacity: int = DEFAULT_DEDUP_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("dedup capacity must be positive")
        self._capacity = capacity
        self._results: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._results)

    def get(self, request_id: bytes) -> bytes | None:
        """The stored result of ``request_id``, or None when it was not applied (or was evicted)."""
        return self._results.get(request_id)

    def put(self, request_id: bytes, result: bytes) -> None:
        """Remember ``result`` for ``request_id``, evicting the oldest entry beyond capacity."""
        self._results[request_id] = result
        while len(self._results) > self._capacity:
            self._results.popitem(last=False)

    def encode(self) -> bytes:
        """Deterministic bytes: count, then (request id, result length, result) in apply order."""
        parts = [_COUNT.pack(len(self._results))]
        for request_id, result in self._results.items():
            parts += (request_id, _COUNT.pack(len(result)), result)
        return b"".join(parts)

    def restore(self, data: bytes) -> None:
        """Replace the contents with :meth:`encode` output.

        Raises:
            ValueError: truncated or trailing bytes.
        """
        view = memoryview(data)
        try:
            (count,), pos = _COUNT.unpack_from(view), _COUNT.size
            results: OrderedDict[bytes, bytes] = OrderedDict()
            for _ in range(count):
                request_id = bytes(view[pos:pos + REQUEST_ID_BYTES])
                (size,) = _COUNT.unpack_from(view, pos + REQUEST_ID_BYTES)
                pos += REQUEST_ID_BYTES + _COUNT.size
                if len(request_id) != REQUEST_ID_BYTES or pos + size > len(view):
                    raise ValueError("truncated dedup table")
                results[request_id] = bytes(view[pos:pos + size])
                pos += size
        except struct.error as exc:
            raise ValueError("truncated dedup table") from exc
        if pos != len(view):
            raise ValueError("trailing bytes after dedup table")
        self._results = results
        while len(self._results) > self._capacity:
            self._results.popitem(last=False)
