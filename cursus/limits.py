"""Protocol limits for Cursus Wire v2, each with the reason it has the value it has.

Every bound the codec enforces lives here so that a reader can audit them in one place
(STYLE-MODELS "What to take" item 5). Names put the unit and qualifier last
(``..._BYTES_MAX``, ``..._COUNT_MAX``). The asserts at the bottom tie related limits
together; they run at import time, so an inconsistent edit fails immediately.

The wire modules re-export some of these under the names the public API uses
(``cursus.wire.frame.MAX_PAYLOAD_BYTES`` and so on).
"""

from __future__ import annotations

# Frame header: fixed 32 bytes (facts A2/B1.1). Not tunable; it is the layout.
FRAME_HEADER_SIZE_BYTES = 32

# Both the encoded and the decoded payload length of one frame are capped at 64 MiB
# (facts A2, B1.1). Every real client rejects larger frames, and the cap is checked from
# the header *before* any payload buffer is allocated, so a peer can never make us
# reserve more than this per connection by lying in a header.
FRAME_PAYLOAD_BYTES_MAX = 64 * 1024 * 1024

# A negotiation frame carries at most 1 KiB (facts B0.2, B1.3). The real payload is
# 6 + 4 bytes; the small cap stops an unauthenticated peer from making the broker
# buffer megabytes before the handshake has even succeeded.
NEGOTIATION_PAYLOAD_BYTES_MAX = 1024

# A negotiation request lists 1-4 compression ids (facts B1.3): there are only four
# codecs and duplicates are rejected, so more than four entries cannot be valid.
NEGOTIATION_COMPRESSIONS_COUNT_MAX = 4

# CRQ2: at most 1024 positionals and 1024 fields (facts A5 5a, B2). Real commands use
# fewer than 20 fields; the cap bounds the per-request dict the broker builds.
CRQ2_POSITIONALS_COUNT_MAX = 1024
CRQ2_FIELDS_COUNT_MAX = 1024

# CBV2: at most 100,000 records per batch (facts A5 5b, B3.1, spec section 5). This
# bounds the offset-position index the broker keeps per batch (8 bytes per record).
BATCH_RECORDS_COUNT_MAX = 100_000

# Typed error payload: at most 256 fields (facts A7, B4.1). Errors are small; the cap
# keeps a hostile or buggy peer from sending a 64 MiB error dict.
ERROR_FIELDS_COUNT_MAX = 256

# Gzip input is fed to zlib in slices of this size so that a payload made of many tiny
# gzip members never makes us copy the remaining input once per member (which would be
# quadratic). 64 KiB is large enough that the per-slice overhead is negligible.
DECOMPRESSION_INPUT_SLICE_BYTES = 64 * 1024

# The incremental frame decoder compacts its buffer (drops consumed bytes) once at least
# this many consumed bytes sit at its front and they are at least half the buffer.
# Compacting only then keeps buffering O(n) overall (each byte is moved O(1) times on
# average) without letting a long-lived connection keep a large dead prefix.
RECEIVE_BUFFER_COMPACT_BYTES_MIN = 64 * 1024

assert FRAME_HEADER_SIZE_BYTES == 4 + 2 + 1 + 1 + 2 + 2 + 8 + 4 + 4 + 4
assert NEGOTIATION_PAYLOAD_BYTES_MAX < FRAME_PAYLOAD_BYTES_MAX
assert 6 + NEGOTIATION_COMPRESSIONS_COUNT_MAX <= NEGOTIATION_PAYLOAD_BYTES_MAX
# The header's u32 length fields must be able to carry the payload limit.
assert FRAME_PAYLOAD_BYTES_MAX <= 0xFFFFFFFF
# A CRQ2/CBV2 count field is u16/u32; the caps must fit in them.
assert CRQ2_POSITIONALS_COUNT_MAX <= 0xFFFF and CRQ2_FIELDS_COUNT_MAX <= 0xFFFF
assert ERROR_FIELDS_COUNT_MAX <= 0xFFFF
# Every record costs at least 4 (length) + 2 + 8 + 4 + 4 + 8 + 4 = 34 bytes, so a batch
# of the maximum record count still fits one frame: the two limits do not contradict.
assert BATCH_RECORDS_COUNT_MAX * 34 < FRAME_PAYLOAD_BYTES_MAX
assert DECOMPRESSION_INPUT_SLICE_BYTES > 0 and RECEIVE_BUFFER_COMPACT_BYTES_MIN > 0
