"""Sans-IO pieces of the session fast path: the plain reply encoder and the byte budget's sync reservation."""

from __future__ import annotations

import asyncio

import pytest

from cursus.broker.session import ByteBudget
from cursus.wire import (
    Command,
    Compression,
    FrameDecoder,
    Kind,
    Status,
    encode_frame,
    encode_plain_frame,
)
from cursus.wire.errors import LocalProtocolError


@pytest.mark.parametrize("command", [Command.PUBLISH, Command.LIST, Command.CONSUME])
@pytest.mark.parametrize("status", [Status.OK, Status.ERROR])
@pytest.mark.parametrize("request_id", [1, 77, (1 << 64) - 1])
@pytest.mark.parametrize("payload", [b"", b"OK", b'{"status":"OK","last_offset":5}' * 40])
def test_plain_frame_is_byte_for_byte_encode_frame(command, status, request_id, payload):
    plain = encode_plain_frame(command, status, request_id, payload)
    assert plain == encode_frame(Kind.RESPONSE, command, status, request_id, payload, compression=Compression.NONE)
    decoder = FrameDecoder(negotiated=Compression.NONE)
    decoder.feed(plain)
    frame = decoder.next_frame()
    assert frame is not None and (frame.command, frame.status, frame.request_id, frame.payload) == (
        command, status, request_id, payload)


@pytest.mark.parametrize("request_id", [0, -1, 1 << 64])
def test_plain_frame_refuses_an_impossible_request_id(request_id):
    with pytest.raises(LocalProtocolError):
        encode_plain_frame(Command.PUBLISH, Status.OK, request_id, b"x")


def test_plain_frame_refuses_a_status_a_response_cannot_carry():
    with pytest.raises(LocalProtocolError):
        encode_plain_frame(Command.PUBLISH, Status.STREAM_END, 1, b"x")
    with pytest.raises(LocalProtocolError):
        encode_plain_frame(Command.PUBLISH, Status.NONE, 1, b"x")


def test_budget_take_reserves_only_what_fits_and_release_wakes_waiters():
    async def scenario() -> None:
        budget = ByteBudget(100)
        assert budget.take(60)
        assert not budget.take(50)  # would not fit: nothing reserved
        assert budget.used_bytes == 60
        waiter = asyncio.ensure_future(budget.acquire(50))
        await asyncio.sleep(0)
        assert not waiter.done()
        budget.release(60)
        assert await asyncio.wait_for(waiter, 5) == 50
        assert budget.used_bytes == 50

    asyncio.run(scenario())
