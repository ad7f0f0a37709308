"""HTTP health endpoints: ``GET /live`` and ``GET /ready`` (facts B8 "Health HTTP").

A deliberately tiny HTTP/1.1 responder on asyncio streams: one request per connection, GET and HEAD only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

ReadyCheck = Callable[[], dict[str, str]]

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable", 400: "Bad Request"}
#: Request line and headers larger than this are refused: health checks are tiny.
MAX_REQUEST_HEAD_BYTES = 8192


def health_response(method: str, path: str, not_ready: ReadyCheck) -> tuple[int, dict[str, object]]:
    """Status code and JSON body for one health request (pure, for tests)."""
    path = path.split("?", 1)[0]
    if path not in ("/live", "/ready"):
        return 404, {"status": "not_found"}
    if method not in ("GET", "HEAD"):
        return 405, {"status": "method_not_allowed"}
    if path == "/live":
        return 200, {"status": "live"}
    reasons = not_ready()
    if reasons:
        return 503, {"status": "not_ready", "checks": reasons}
    return 200, {"status": "ready", "checks": {"recovery": "ok", "storage": "ok"}}


async def serve_health(host: str, port: int, not_ready: ReadyCheck) -> asyncio.Server:
    """Start the health listener; ``not_ready()`` returns {check: reason} (empty when ready)."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            if len(head) > MAX_REQUEST_HEAD_BYTES:
                raise ValueError("request head too large")
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            body: dict[str, object]
            if len(parts) != 3:
                code, body = 400, {"status": "bad_request"}
                method = "GET"
            else:
                method = parts[0]
                code, body = health_response(method, parts[1], not_ready)
            data = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {code} {_REASONS[code]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + (b"" if method == "HEAD" else data)
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(on_connection, host, port, limit=MAX_REQUEST_HEAD_BYTES)
