"""The request path's shortcuts give exactly what the general code gave: the AckResponse template, cached
metric children."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from cursus.broker.handlers.produce import _ack
from cursus.broker.metrics import BrokerMetrics

_I64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)


@given(last_offset=_I64, producer_id=st.text(), epoch=_I64, seq_start=_I64, seq_end=_I64)
def test_ack_template_is_byte_for_byte_the_json_envelope(
        last_offset: int, producer_id: str, epoch: int, seq_start: int, seq_end: int) -> None:
    doc = {"status": "OK", "last_offset": last_offset, "producer_epoch": epoch, "producer_id": producer_id,
           "seq_start": seq_start, "seq_end": seq_end}
    assert _ack(last_offset, producer_id, epoch, seq_start, seq_end) == json.dumps(
        doc, separators=(",", ":")).encode("utf-8")


class _Replica:
    topic = "t"
    partition = 3
    log_start_offset = 0
    leo = 7
    hwm = 5


def test_cached_children_are_the_labelled_children_and_forgetting_drops_them() -> None:
    metrics = BrokerMetrics()
    ok = metrics.child(metrics.commands_total, "PUBLISH", "ok")
    assert ok is metrics.child(metrics.commands_total, "PUBLISH", "ok")
    ok.inc()
    assert metrics.commands_total.labels("PUBLISH", "ok")._value.get() == 1

    replica = _Replica()
    metrics.observe_replica(replica)  # type: ignore[arg-type]
    assert b'cursus_partition_high_watermark{partition="3",topic="t"} 5.0' in generate_latest(metrics.registry)
    metrics.forget_partition("t", 3)
    assert b"cursus_partition_high_watermark{" not in generate_latest(metrics.registry)
    # Re-created (a topic of the same name): the gauges are exported again, not written to removed children.
    replica.hwm = 6
    metrics.observe_replica(replica)  # type: ignore[arg-type]
    assert b'cursus_partition_high_watermark{partition="3",topic="t"} 6.0' in generate_latest(metrics.registry)


@given(amounts=st.lists(st.one_of(st.floats(min_value=0, max_value=100, allow_nan=False),
                                  st.sampled_from([0.0005, 0.001, 0.0025, 10.0, 30.0])), max_size=30))
def test_loop_histogram_child_exports_what_the_prometheus_child_does(amounts: list[float]) -> None:
    fast, reference = BrokerMetrics(), BrokerMetrics()
    child = fast.child(fast.command_duration, "PUBLISH")
    counter = fast.child(fast.commands_total, "PUBLISH", "ok")
    reference.command_duration.labels("PUBLISH")
    reference.commands_total.labels("PUBLISH", "ok")
    for amount in amounts:
        child.observe(amount)
        counter.inc()
        reference.command_duration.labels("PUBLISH").observe(amount)
        reference.commands_total.labels("PUBLISH", "ok").inc()
    def samples(metrics: BrokerMetrics) -> list[bytes]:
        return [line for line in generate_latest(metrics.registry).splitlines()
                if line.startswith((b"cursus_broker_command_duration", b"cursus_broker_commands_total"))]
    assert samples(fast) == samples(reference)


def test_partition_offsets_are_read_at_scrape_time() -> None:
    metrics = BrokerMetrics()
    replica = _Replica()
    metrics.observe_replica(replica)  # type: ignore[arg-type]
    replica.hwm, replica.leo = 9, 12
    text = generate_latest(metrics.registry)
    assert b'cursus_partition_high_watermark{partition="3",topic="t"} 9.0' in text
    assert b'cursus_partition_log_end_offset{partition="3",topic="t"} 12.0' in text
    assert b'cursus_partition_log_start_offset{partition="3",topic="t"} 0.0' in text
