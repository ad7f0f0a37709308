"""``KeyValueFSM``: a tiny deterministic state machine for tests, benchmarks and the dev node.

Commands are JSON objects (encode them with :func:`kv_command`): ``{"op": "set", "key": k, "value": v}``
returns the previous value; ``{"op": "append", "key": k, "value": v}`` appends to the list at ``k`` and
returns its new length; ``{"op": "get", "key": k}`` returns the value. Results are JSON bytes. An unknown
or malformed command returns ``{"error": ...}`` (deterministically), it never raises.
"""

from __future__ import annotations

import json
from typing import Any


def kv_command(op: str, key: str, value: Any = None) -> bytes:
    """Deterministic command bytes (sorted keys, no whitespace)."""
    return json.dumps({"op": op, "key": key, "value": value}, sort_keys=True,
                      separators=(",", ":")).encode()


def _dump(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


class KeyValueFSM:
    """A dict of JSON values; see the module docstring for the commands."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def apply(self, command: bytes) -> bytes:
        try:
            request = json.loads(command)
            op, key, value = request["op"], str(request["key"]), request.get("value")
        except (ValueError, KeyError, TypeError):
            return _dump({"error": "malformed"})
        if op == "set":
            previous = self.data.get(key)
            self.data[key] = value
            return _dump({"previous": previous})
        if op == "append":
            items = self.data.setdefault(key, [])
            if not isinstance(items, list):
                return _dump({"error": "not_a_list"})
            items.append(value)
            return _dump({"length": len(items)})
        if op == "get":
            return _dump({"value": self.data.get(key)})
        return _dump({"error": "unknown_op"})

    def snapshot(self) -> bytes:
        return _dump(self.data)

    def restore(self, data: bytes) -> None:
        self.data = dict(json.loads(data))
