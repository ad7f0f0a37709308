"""RecordEncoder.encode_run (the producer's batch encoding) is byte-for-byte the per-record encoding joined."""

from __future__ import annotations

import random

from cursus.wire import RecordEncoder, encode_text_field


def test_encode_run_equals_joined_records():
    rng = random.Random(7)
    encoder = RecordEncoder("orders-é", 3, "py-0123456789abcdef", 1_700_000_000_123)
    for _ in range(200):
        count = rng.randint(1, 40)
        values = [rng.randbytes(rng.choice((0, 1, 100, 1000))) for _ in range(count)]
        keys = [None if rng.random() < 0.5 else encode_text_field(f"k{rng.random()}") for _ in range(count)]
        stamps = [rng.randint(-(1 << 40), 1 << 62) for _ in range(count)]
        seq = rng.randint(1, 1 << 40)
        expected = b"".join(encoder.encode(v, k, t, seq + i) for i, (v, k, t) in enumerate(zip(values, keys, stamps,
                                                                                                strict=True)))
        assert encoder.encode_run(values, keys, stamps, seq) == expected


def test_encode_run_rejects_unequal_lengths():
    encoder = RecordEncoder("t", 0, "p", 1)
    try:
        encoder.encode_run([b"a", b"b"], [None], [1, 2], 1)
    except ValueError:
        return
    raise AssertionError("unequal sequences were accepted")
