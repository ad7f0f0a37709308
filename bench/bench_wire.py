"""Wire codec throughput: the broker's CBV2 hot path and the frame codec.

``run()`` returns one dict per measurement. Each measurement repeats its operation and
reports the median time, converted to records (or frames) per second on one core.

* ``scan_stamp`` - ``scan_batch`` + ``stamp_offsets`` of a 1,000-record batch shaped like
  an SDK batch (producer bit set, seq 1..1000, 100-byte payloads): the validate-and-index
  pass a PUBLISH goes through before its bytes are appended to the log. Three shapes:
  ``uniform`` (every record the same length - the fastest tier), ``varied_payload``
  (payload 50-150 bytes, template tier), ``varied_key`` (a different key per record,
  which forces the strict per-record walk).
* ``encode_batch`` - building the same batch from ``Record`` objects (SDK side).
* ``decode_batch`` - full object decode (SDK consumer side).
* ``frame_roundtrip`` - ``encode_frame`` + ``FrameDecoder`` of a 100 KiB payload, per codec.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from cursus.wire import (
    Batch,
    Command,
    Compression,
    FrameDecoder,
    Kind,
    Record,
    Status,
    decode_batch,
    encode_batch,
    encode_frame,
    scan_batch,
    stamp_offsets,
)

RECORDS = 1_000
PAYLOAD_BYTES = 100
PRODUCER_ID = "py-0123456789abcdef"
PRODUCER_EPOCH = 1_767_225_600


def _median_seconds(operation: Callable[[], object], repeats: int) -> float:
    operation()  # warm caches (struct formats, allocator)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        operation()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def make_batch(*, varied_payload: bool = False, varied_key: bool = False, seed: int = 7) -> Batch:
    """An SDK-shaped batch: producer group on every record, contiguous seqs from 1."""
    rng = random.Random(seed)
    records = []
    for index in range(RECORDS):
        size = rng.randint(50, 150) if varied_payload else PAYLOAD_BYTES
        records.append(
            Record(
                topic="orders",
                partition=3,
                payload=rng.randbytes(size),
                producer_id=PRODUCER_ID,
                seq_num=index + 1,
                producer_epoch=PRODUCER_EPOCH,
                key=f"customer-{rng.randrange(10**6)}" if varied_key else None,
            )
        )
    return Batch("orders", 3, "-1", records, idempotent=True)


def _scan_stamp_result(shape: str, batch: Batch, repeats: int) -> dict[str, object]:
    data = bytearray(encode_batch(batch))

    def scan_and_stamp() -> None:
        view = scan_batch(data)
        stamp_offsets(data, view.offset_positions, 1_000_000)

    seconds = _median_seconds(scan_and_stamp, repeats)
    return {
        "bench": "scan_stamp",
        "shape": shape,
        "records": RECORDS,
        "batch_bytes": len(data),
        "us_per_batch": round(seconds * 1e6, 1),
        "records_per_s": round(RECORDS / seconds),
    }


def _codec_result(name: str, operation: Callable[[], object], repeats: int) -> dict[str, object]:
    seconds = _median_seconds(operation, repeats)
    return {
        "bench": name,
        "records": RECORDS,
        "us_per_batch": round(seconds * 1e6, 1),
        "records_per_s": round(RECORDS / seconds),
    }


def _frame_result(codec: Compression, repeats: int) -> dict[str, object]:
    rng = random.Random(11)
    words = [rng.randbytes(4).hex() for _ in range(512)]
    payload = " ".join(rng.choice(words) for _ in range(12_000)).encode()[: 100 * 1024]

    def roundtrip() -> None:
        decoder = FrameDecoder(negotiated=codec)
        decoder.feed(encode_frame(Kind.REQUEST, Command.PUBLISH, Status.NONE, 1, payload, compression=codec))
        decoder.next_frame()

    seconds = _median_seconds(roundtrip, repeats)
    return {
        "bench": "frame_roundtrip",
        "compression": codec.name.lower(),
        "payload_bytes": len(payload),
        "us_per_frame": round(seconds * 1e6, 1),
        "mib_per_s": round(len(payload) / seconds / (1 << 20), 1),
    }


def run() -> list[dict[str, object]]:
    """Run every wire measurement (a few seconds in total)."""
    uniform = make_batch()
    results = [
        _scan_stamp_result("uniform", uniform, 300),
        _scan_stamp_result("varied_payload", make_batch(varied_payload=True), 100),
        _scan_stamp_result("varied_key", make_batch(varied_key=True), 50),
    ]
    encoded = encode_batch(uniform)
    results.append(_codec_result("encode_batch", lambda: encode_batch(uniform), 30))
    results.append(_codec_result("decode_batch", lambda: decode_batch(encoded), 30))
    results.extend(_frame_result(codec, 30) for codec in Compression)
    return results
