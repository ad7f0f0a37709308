"""Negotiation payloads and codec selection (facts A3, B1.3, decision 4)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cursus.wire import (
    MAX_NEGOTIATION_PAYLOAD,
    Compression,
    InvalidFrame,
    LocalProtocolError,
    NegotiationRequest,
    decode_negotiation_request,
    decode_negotiation_response,
    encode_negotiation_request,
    encode_negotiation_response,
    select_compression,
)

requests = st.builds(
    NegotiationRequest,
    st.integers(1, 0xFFFF),
    st.integers(0, 0xFFFF),
    st.permutations(list(Compression)).flatmap(lambda p: st.integers(1, 4).map(lambda n: tuple(p[:n]))),
).filter(lambda r: r.max_version >= r.min_version)


@given(requests)
def test_request_roundtrip(request: NegotiationRequest) -> None:
    assert decode_negotiation_request(encode_negotiation_request(request)) == request


@given(st.integers(0, 0xFFFF), st.sampled_from(list(Compression)))
def test_response_roundtrip(version: int, compression: Compression) -> None:
    assert decode_negotiation_response(encode_negotiation_response(version, compression)) == (version, compression)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00\x02\x00\x02\x00",  # short head
        b"\x00\x02\x00\x02\x00\x00",  # count 0
        b"\x00\x02\x00\x02\x00\x05\x00\x01\x02\x03\x00",  # count 5
        b"\x00\x02\x00\x02\x00\x02\x01\x01",  # duplicate
        b"\x00\x02\x00\x02\x00\x01\x04",  # unknown id
        b"\x00\x00\x00\x02\x00\x01\x00",  # min 0
        b"\x00\x03\x00\x02\x00\x01\x00",  # max < min
        b"\x00\x02\x00\x02\x00\x01\x00\x00",  # trailing byte
        b"\x00\x02\x00\x02\x00\x02\x00",  # count says 2, one id
    ],
)
def test_request_rejects(payload: bytes) -> None:
    with pytest.raises(InvalidFrame):
        decode_negotiation_request(payload)


@pytest.mark.parametrize("payload", [b"", b"\x00\x02", b"\x00\x02\x04", b"\x00\x02\x00\x00"])
def test_response_rejects(payload: bytes) -> None:
    with pytest.raises(InvalidFrame):
        decode_negotiation_response(payload)


def test_encode_request_rejects_invalid() -> None:
    with pytest.raises(LocalProtocolError):
        encode_negotiation_request(NegotiationRequest(2, 2, ()))
    with pytest.raises(LocalProtocolError):
        encode_negotiation_request(NegotiationRequest(3, 2, (Compression.NONE,)))


def test_select_compression_prefers_client_order() -> None:
    offer = NegotiationRequest(2, 2, (Compression.LZ4, Compression.GZIP, Compression.NONE))
    assert select_compression(offer) == Compression.LZ4
    assert select_compression(offer, (Compression.GZIP, Compression.NONE)) == Compression.GZIP
    assert select_compression(offer, ()) is None
    assert select_compression(NegotiationRequest(3, 4, (Compression.NONE,))) is None
    assert select_compression(NegotiationRequest(1, 1, (Compression.NONE,))) is None
    assert select_compression(NegotiationRequest(1, 3, (Compression.SNAPPY,))) == Compression.SNAPPY


def test_limit() -> None:
    assert MAX_NEGOTIATION_PAYLOAD == 1024
