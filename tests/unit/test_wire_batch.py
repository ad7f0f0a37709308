"""CBV2 batches and records, and the broker's scan/stamp hot path (facts A5 5b, B3.1, B3.2)."""

from __future__ import annotations

import array
import dataclasses
import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cursus.wire.batch as batch_module
import cursus.wire.scan as scan_module
from cursus.wire import (
    MAX_RECORDS_PER_BATCH,
    Batch,
    BatchView,
    InvalidFrame,
    LocalProtocolError,
    Presence,
    Record,
    decode_batch,
    decode_record,
    encode_batch,
    encode_batch_header,
    encode_record,
    is_cbv2,
    iter_record_slices,
    record_offset_field_position,
    scan_batch,
    stamp_offsets,
)

I64 = st.integers(-(2**63), 2**63 - 1)
U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=12)
BLOB = st.binary(max_size=12)

# (bit, Record attribute, value strategy); the producer group is handled separately.
OPTIONAL = [
    (Presence.TIMESTAMP, "timestamp", I64),
    (Presence.KEY, "key", TEXT),
    (Presence.EVENT_TYPE, "event_type", TEXT),
    (Presence.SCHEMA_VERSION, "schema_version", st.integers(0, 2**32 - 1)),
    (Presence.AGGREGATE_VERSION, "aggregate_version", U64),
    (Presence.METADATA, "metadata", TEXT),
    (Presence.TRANSACTIONAL_ID, "transactional_id", TEXT),
    (Presence.TRANSACTION_STATE, "transaction_state", st.sampled_from(["open", "committed", "aborted"]) | TEXT),
    (Presence.TRANSACTION_MARKER, "transaction_marker", st.sampled_from(["commit", "abort"]) | TEXT),
    (Presence.CONTROL_TYPE, "control_type", TEXT),
    (Presence.CONTROL_VERSION, "control_version", st.integers(-(2**15), 2**15 - 1)),
    (Presence.CONTROL_COORDINATOR_EPOCH, "control_coordinator_epoch", I64),
    (Presence.CONTROL_KEY, "control_key", BLOB),
    (Presence.CONTROL_VALUE, "control_value", BLOB),
    (Presence.EVENT_ID, "event_id", TEXT),
    (Presence.PAYLOAD_DIGEST, "payload_digest", TEXT),
]
ALL_BITS = [1 << bit for bit in range(17)]


@st.composite
def records(draw: st.DrawFn, topic: str = "t", partition: int = 0, presence: int | None = None) -> Record:
    """A record whose presence covers single bits and arbitrary combinations, both versions."""
    if presence is None:
        presence = draw(st.sampled_from(ALL_BITS) | st.integers(0, 0x1FFFF) | st.just(0x1FFFF) | st.just(0x7FFF))
    version = 3 if presence & 0x18000 else draw(st.sampled_from([2, 3]))
    fields: dict[str, object] = {}
    for bit, attribute, strategy in OPTIONAL:
        if presence & bit:
            fields[attribute] = draw(strategy)
    if presence & Presence.PRODUCER:
        fields["producer_id"] = draw(TEXT)
        fields["seq_num"] = draw(U64)
        fields["producer_epoch"] = draw(I64)
    return Record(topic, partition, draw(st.binary(max_size=40)), draw(U64), version, **fields)


@st.composite
def batches(draw: st.DrawFn, max_records: int = 5) -> Batch:
    topic = draw(TEXT)
    partition = draw(I32)
    recs = draw(st.lists(records(topic, partition), max_size=max_records))
    return Batch(topic, partition, draw(st.sampled_from(sorted(batch_module.ACKS_VALUES))), recs,
                 idempotent=draw(st.booleans()), seq_start=draw(st.just(0) | U64), seq_end=draw(st.just(0) | U64))


def expected_after_roundtrip(b: Batch) -> Batch:
    first = b.records[0].seq_num if b.records else 0
    last = b.records[-1].seq_num if b.records else 0
    return dataclasses.replace(b, seq_start=b.seq_start or first, seq_end=b.seq_end or last)


@st.composite
def shaped_batches(draw: st.DrawFn) -> Batch:
    """SDK-like batches: records share a shape, with per-record variations that move them
    between the scan tiers (same/different payload length, key, timestamp, seq, shape)."""
    rnd = draw(st.randoms(use_true_random=False))
    count = draw(st.integers(1, 130))
    presence = Presence.PRODUCER | draw(st.sampled_from([0, Presence.KEY, Presence.TIMESTAMP | Presence.KEY,
                                                          Presence.EVENT_TYPE | Presence.METADATA, Presence.TIMESTAMP]))
    base = draw(records("orders", 3, presence=int(presence)))
    vary = {name: draw(st.booleans()) for name in ("payload_size", "key", "timestamp", "seq", "odd")}
    out = []
    for index in range(count):
        record = dataclasses.replace(base, seq_num=(base.seq_num + index) % 2**64, offset=0)
        size = rnd.randint(0, 30) if vary["payload_size"] else len(base.payload)
        record.payload = rnd.randbytes(size)
        if vary["key"] and record.key is not None:
            record.key = rnd.choice(["k", "key-1", "é", "customer-42"])
        if vary["timestamp"] and record.timestamp is not None:
            record.timestamp = rnd.randint(-(2**63), 2**63 - 1)
        if vary["seq"] and rnd.random() < 0.1:
            record.seq_num = rnd.randint(0, 2**64 - 1)
        if vary["odd"] and rnd.random() < 0.05:
            record = dataclasses.replace(record, producer_id=record.producer_id + "x", version=3)
        out.append(record)
    return Batch("orders", 3, "-1", out, idempotent=True)


@given(records())
def test_record_roundtrip(record: Record) -> None:
    raw = encode_record(record)
    assert decode_record(raw) == record
    assert encode_record(decode_record(raw)) == raw


@pytest.mark.parametrize("bit", ALL_BITS + [0, 0x7FFF, 0x1FFFF])
@given(data=st.data())
def test_each_presence_bit_alone_and_all(bit: int, data: st.DataObject) -> None:
    record = data.draw(records("topic", 7, presence=bit))
    raw = encode_record(record)
    assert int.from_bytes(raw[2:10], "big") == bit
    assert decode_record(raw) == record
    batch = Batch("topic", 7, "1", [record, record])
    encoded = encode_batch(batch)
    assert decode_batch(encoded).records == [record, record]
    view = scan_batch(encoded)
    assert view.has_transactional == bool(bit & 0x7F80)


@given(batches())
def test_batch_roundtrip(b: Batch) -> None:
    raw = encode_batch(b)
    assert is_cbv2(raw)
    decoded = decode_batch(raw)
    assert decoded == expected_after_roundtrip(b)
    assert encode_batch(decoded) == raw


def reference_view(b: Batch) -> dict[str, object]:
    """What scan_batch must report, computed from the decoded objects."""
    recs = b.records
    first, last = (recs[0], recs[-1]) if recs else (None, None)
    uniform = bool(recs) and all(
        r.producer_id is not None and r.producer_id == recs[0].producer_id
        and r.producer_epoch == recs[0].producer_epoch and r.seq_num == recs[0].seq_num + i
        for i, r in enumerate(recs)
    )
    return {
        "record_count": len(recs),
        "producer_id": first.producer_id if first else None,
        "producer_epoch": first.producer_epoch if first and first.producer_id is not None else 0,
        "first_seq": first.seq_num if first and first.producer_id is not None else 0,
        "last_seq": last.seq_num if last and last.producer_id is not None else 0,
        "uniform_producer": uniform,
        "has_transactional": any(int(r.presence) & 0x7F80 for r in recs),
        "max_record_size": max((len(encode_record(r)) for r in recs), default=0),
    }


def check_view_against_decode(raw: bytes, view: BatchView) -> None:
    decoded = decode_batch(raw)
    got = {key: getattr(view, key) for key in reference_view(decoded)}
    assert got == reference_view(decoded)
    assert (view.topic, view.partition, view.acks, view.idempotent) == (
        decoded.topic, decoded.partition, decoded.acks, decoded.idempotent,
    )
    assert (view.seq_start, view.seq_end) == (decoded.seq_start, decoded.seq_end)
    assert list(view.offset_positions) == [
        start + record_offset_field_position(len(decoded.topic.encode()))
        for start in record_starts(raw, view.records_offset, view.record_count)
    ]
    for position, record in zip(view.offset_positions, decoded.records, strict=True):
        assert struct.unpack_from(">Q", raw, position)[0] == record.offset
    buf = bytearray(raw)
    stamp_offsets(buf, view.offset_positions, 1000)
    assert [r.offset for r in decode_batch(buf).records] == list(range(1000, 1000 + view.record_count))


def record_starts(raw: bytes, position: int, count: int) -> list[int]:
    starts = []
    for _ in range(count):
        (length,) = struct.unpack_from(">I", raw, position)
        starts.append(position + 4)
        position += 4 + length
    return starts


@given(batches())
def test_scan_agrees_with_decode_on_random_batches(b: Batch) -> None:
    raw = encode_batch(b)
    check_view_against_decode(raw, scan_batch(raw))


@given(shaped_batches())
def test_scan_agrees_with_decode_on_shaped_batches(b: Batch) -> None:
    raw = encode_batch(b)
    check_view_against_decode(raw, scan_batch(raw))
    check_view_against_decode(raw, scan_batch(bytearray(raw)))
    check_view_against_decode(raw, scan_batch(memoryview(raw)))


def verdict(function, data: bytes) -> str:  # noqa: ANN001
    try:
        function(data)
    except InvalidFrame:
        return "invalid"
    return "ok"


@given(shaped_batches(), st.lists(st.tuples(st.integers(0, 2**32), st.integers(0, 7), st.integers(0, 3)),
                                  min_size=1, max_size=3))
def test_fast_paths_reject_exactly_what_decode_rejects(b: Batch, mutations: list[tuple[int, int, int]]) -> None:
    data = bytearray(encode_batch(b))
    for where, bit, kind in mutations:
        position = where % len(data)
        if kind == 0:
            data[position] ^= 1 << bit
        elif kind == 1:
            data[position] = (data[position] + 1) % 256
        elif kind == 2:
            del data[position]
        else:
            data.insert(position, bit)
    raw = bytes(data)
    assert verdict(scan_batch, raw) == verdict(decode_batch, raw)
    if verdict(decode_batch, raw) == "ok":
        check_view_against_decode(raw, scan_batch(raw))


def sdk_batch(count: int, *, payload_sizes: list[int] | None = None, keys: list[str] | None = None) -> Batch:
    rng = random.Random(5)
    out = []
    for index in range(count):
        size = payload_sizes[index % len(payload_sizes)] if payload_sizes else 100
        key = keys[index % len(keys)] if keys else None
        out.append(Record("orders", 3, rng.randbytes(size), producer_id="py-abc", seq_num=index + 1,
                          producer_epoch=1_700_000_000, key=key))
    return Batch("orders", 3, "-1", out, idempotent=True)


@pytest.fixture
def strict_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = scan_module._walk_record

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(scan_module, "_walk_record", counting)
    return calls


@pytest.mark.parametrize(
    ("batch", "walks"),
    [
        (sdk_batch(200), 1),  # uniform tier
        (sdk_batch(200, payload_sizes=[10, 99, 150]), 1),  # template tier
        (sdk_batch(200, keys=["a", "bb", "ccc"]), 1),  # template tier, suffix walked
        (sdk_batch(10), 1),  # small batch: template tier
    ],
)
def test_tiers_avoid_strict_walks(batch: Batch, walks: int, strict_walks: list[int]) -> None:
    raw = encode_batch(batch)
    view = scan_batch(raw)
    assert len(strict_walks) == walks
    assert view.uniform_producer and view.producer_id == "py-abc" and view.first_seq == 1
    assert view.last_seq == len(batch.records)
    check_view_against_decode(raw, view)


def test_uniform_tier_detects_a_bad_record_in_the_middle() -> None:
    raw = bytearray(encode_batch(sdk_batch(100)))
    view = scan_batch(raw)
    record_start = view.offset_positions[50] - record_offset_field_position(len("orders"))
    bad = bytearray(raw)
    bad[record_start + 2] = 0x01  # presence bit 56: unknown
    with pytest.raises(InvalidFrame):
        scan_batch(bad)
    with pytest.raises(InvalidFrame):
        decode_batch(bad)
    payload_byte = view.offset_positions[70] + 8 + 4 + 5
    ok = bytearray(raw)
    ok[payload_byte] ^= 0xFF
    check_view_against_decode(bytes(ok), scan_batch(ok))
    seq_gap = bytearray(raw)
    seq_gap[len(raw) - 9] ^= 0x01  # the last record ends with seq (8 bytes) and epoch (8 bytes)
    assert not scan_batch(seq_gap).uniform_producer


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:4] + b"X" + b[5:],  # magic
        lambda b: b[:5] + b"\x03" + b[6:],  # version
        lambda b: b[:7] + b"\x02" + b[8:],  # flags bit 1
        lambda b: b + b"\x00",  # trailing
        lambda b: b[:-1],  # truncated
    ],
)
@pytest.mark.parametrize("records", [1, 3])  # a lone record takes its own path (no template)
def test_batch_rejects(mutate, records: int) -> None:  # noqa: ANN001
    raw = mutate(encode_batch(sdk_batch(records)))
    with pytest.raises(InvalidFrame):
        decode_batch(raw)
    with pytest.raises(InvalidFrame):
        scan_batch(raw)


def raw_batch(records_bytes: list[bytes], *, topic: bytes = b"t", acks: bytes = b"1", count: int | None = None) -> bytes:
    head = b"CBV2\x00\x02\x00\x00" + struct.pack(">I", len(topic)) + topic + struct.pack(">i", 0)
    head += struct.pack(">I", len(acks)) + acks + struct.pack(">QQI", 0, 0, len(records_bytes) if count is None else count)
    return head + b"".join(struct.pack(">I", len(r)) + r for r in records_bytes)


def raw_record(version: int = 2, presence: int = 0, topic: bytes = b"t", partition: int = 0, tail: bytes = b"") -> bytes:
    return (struct.pack(">HQ", version, presence) + struct.pack(">I", len(topic)) + topic
            + struct.pack(">iQ", partition, 0) + struct.pack(">I", 1) + b"p" + tail)


@pytest.mark.parametrize(
    "raw",
    [
        raw_batch([], acks=b"leader"),
        raw_batch([], acks=b"2"),
        raw_batch([], count=MAX_RECORDS_PER_BATCH + 1),
        raw_batch([], count=1),
        raw_batch([], topic=b"\xff"),
        raw_batch([raw_record(version=1)]),
        raw_batch([raw_record(version=4)]),
        raw_batch([raw_record(presence=1 << 15)]),  # v3-only bit in v2
        raw_batch([raw_record(version=3, presence=1 << 17)]),
        raw_batch([raw_record(topic=b"u")]),
        raw_batch([raw_record(topic=b"\xff")]),
        raw_batch([raw_record(partition=1)]),
        raw_batch([raw_record(tail=b"\x00")]),  # trailing byte in the record
        raw_batch([raw_record(presence=4, tail=struct.pack(">I", 1) + b"\xff")]),  # key not UTF-8
        raw_batch([raw_record(presence=4, tail=struct.pack(">I", 5) + b"ab")]),  # key past end
        raw_batch([raw_record(presence=2, tail=struct.pack(">I", 1) + b"p" + bytes(15))]),  # short seq/epoch
        raw_batch([raw_record()[:20]]),
    ],
)
def test_record_level_rejects(raw: bytes) -> None:
    with pytest.raises(InvalidFrame):
        decode_batch(raw)
    with pytest.raises(InvalidFrame):
        scan_batch(raw)


def test_acks_values_accepted() -> None:
    for acks in (b"", b"0", b"none", b"1", b"-1", b"all"):
        assert decode_batch(raw_batch([raw_record()], acks=acks)).acks == acks.decode()
        assert scan_batch(raw_batch([raw_record()], acks=acks)).acks == acks.decode()


def test_encode_rejects() -> None:
    good = Record("t", 0, b"x")
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, version=4))
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, seq_num=1))
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, offset=-1))
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, partition=2**31))
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, control_version=2**15))
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, key=b"bytes"))  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        encode_record(dataclasses.replace(good, payload="text"))  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        encode_batch(Batch("t", 1, "1", [good]))
    with pytest.raises(LocalProtocolError):
        encode_batch(Batch("t", 0, "leader", [good]))
    with pytest.raises(LocalProtocolError):
        encode_batch_header("t", 0, flags=2, record_count=0)
    with pytest.raises(LocalProtocolError):
        encode_batch_header("t", 0, record_count=MAX_RECORDS_PER_BATCH + 1)


def test_v3_fields_raise_version() -> None:
    record = Record("t", 0, b"x", event_id="e-1")
    decoded = decode_record(encode_record(record))
    assert decoded.version == 3 and decoded.event_id == "e-1"
    assert decode_record(encode_record(Record("t", 0, b"x"))).version == 2


def test_seq_fill_and_header_plus_section() -> None:
    b = sdk_batch(4)
    raw = encode_batch(b)
    decoded = decode_batch(raw)
    assert (decoded.seq_start, decoded.seq_end) == (1, 4)
    view = scan_batch(raw)
    header = encode_batch_header("orders", 3, acks="-1", flags=1, seq_start=1, seq_end=4, record_count=4)
    assert header == raw[: view.records_offset]
    section = raw[view.records_offset :]
    slices = [bytes(s) for s in iter_record_slices(section, 4)]
    assert [decode_record(s) for s in slices] == b.records
    assert encode_batch_header("orders", 3, record_count=0) + b"" == encode_batch(Batch("orders", 3, "1", []))


def test_iter_record_slices_rejects() -> None:
    section = struct.pack(">I", 2) + b"ab"
    with pytest.raises(InvalidFrame):
        list(iter_record_slices(section + b"\x00", 1))
    with pytest.raises(InvalidFrame):
        list(iter_record_slices(section, 2))
    with pytest.raises(InvalidFrame):
        list(iter_record_slices(struct.pack(">I", 3) + b"ab", 1))


def test_record_offset_field_position() -> None:
    raw = encode_record(Record("topic-é", 0, b"x", offset=0x0102030405060708))
    position = record_offset_field_position(len("topic-é".encode()))
    assert raw[position : position + 8] == bytes(range(1, 9))


@pytest.mark.parametrize("count", [1, 3, 63, 64, 200])
@pytest.mark.parametrize("container", ["scanned", "array", "list"])
def test_stamp_offsets(count: int, container: str) -> None:
    raw = encode_batch(sdk_batch(count, payload_sizes=[100]))
    view = scan_batch(raw)
    scanned = view.offset_positions  # a range for a records matrix, else an array
    positions = {"scanned": scanned, "array": array.array("Q", scanned), "list": list(scanned)}[container]
    buf = bytearray(raw)
    stamp_offsets(buf, positions, 2**40)
    assert [r.offset for r in decode_batch(buf).records] == [2**40 + i for i in range(count)]
    stamp_offsets(memoryview(buf), positions, 5)
    assert [r.offset for r in decode_batch(buf).records] == [5 + i for i in range(count)]


def test_stamp_offsets_irregular_positions_and_errors() -> None:
    buf = bytearray(200)
    positions = array.array("Q", [0, 8, 20, 100] + [120 + 8 * i for i in range(8)])
    stamp_offsets(buf, positions, 7)
    assert [struct.unpack_from(">Q", buf, p)[0] for p in positions] == list(range(7, 19))
    many = array.array("Q", range(0, 80 * 10, 10))
    many[40] += 1  # not an arithmetic progression: the per-position loop
    big = bytearray(1000)
    stamp_offsets(big, many, 0)
    assert [struct.unpack_from(">Q", big, p)[0] for p in many] == list(range(80))
    stamp_offsets(buf, [], 0)
    with pytest.raises(LocalProtocolError):
        stamp_offsets(buf, [0], 2**64)
    with pytest.raises(LocalProtocolError):
        stamp_offsets(buf, [0, 8], 2**64 - 1)
    with pytest.raises(LocalProtocolError):
        stamp_offsets(buf, [195], 0)


def test_is_cbv2() -> None:
    assert is_cbv2(b"CBV2\x00\x02") and not is_cbv2(b"CBV2\x00\x01") and not is_cbv2(b"CBV2")
    assert not is_cbv2(b"CRQ2\x00\x02")


UNIFORM_RAW = encode_batch(sdk_batch(80, keys=["key-1"]))


@given(st.integers(0, len(UNIFORM_RAW) - 1), st.integers(0, 7))
def test_uniform_tier_bit_flips_match_decode(position: int, bit: int) -> None:
    data = bytearray(UNIFORM_RAW)
    data[position] ^= 1 << bit
    raw = bytes(data)
    assert verdict(scan_batch, raw) == verdict(decode_batch, raw)
    if verdict(decode_batch, raw) == "ok":
        check_view_against_decode(raw, scan_batch(raw))
