"""Pipe record packing: round trip, name table, framing under arbitrary splits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from otel_straggler.export import wire
from otel_straggler.interval import Interval

intervals = st.builds(
    Interval,
    name=st.text(min_size=1, max_size=40),
    level=st.integers(0, 2),
    group=st.sampled_from(["forward", "backward", "other"]),
    step=st.integers(0, 2**40),
    repeat=st.integers(0, 1000),
    host_start_ns=st.integers(0, 2**62),
    host_end_ns=st.integers(0, 2**62),
    device_ms=st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)),
    degraded=st.one_of(st.none(), st.sampled_from(["no_cuda", "sampled_out", "cuda_error"])),
    tokens=st.one_of(st.none(), st.integers(0, 2**40)),
    sequences=st.one_of(st.none(), st.integers(0, 2**20)),
    microbatches=st.one_of(st.none(), st.integers(0, 1024)),
    injected=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(intervals, max_size=20), max_size=5), st.integers(1, 97))
def test_round_trip_any_split(batches: list[list[Interval]], chunk: int) -> None:
    enc = wire.WireEncoder()
    stream = bytearray()
    for batch in batches:
        stream += enc.encode_intervals(batch)
        enc.commit()
    stream += wire.encode_stats({"intervals": 3, "readout_lag_ms": 1.5})
    stream += wire.encode_flush(7, 2.5)
    dec = wire.WireDecoder()
    msgs = []
    for i in range(0, len(stream), chunk):
        msgs.extend(dec.feed(bytes(stream[i : i + chunk])))
    got = [m[1] for m in msgs if m[0] == wire.T_INTERVALS]
    assert got == [b for b in batches if b]  # an empty batch sends nothing
    assert msgs[-2] == (wire.T_STATS, {"intervals": 3, "readout_lag_ms": 1.5})
    assert msgs[-1] == (wire.T_FLUSH, (7, 2500))


def test_names_sent_once_and_resent_after_rollback_or_reset() -> None:
    iv = Interval("forward-compute", 1, "forward", 1, 0, 10, 20, None, "no_cuda", None, None, None, False)
    enc = wire.WireEncoder()
    first = enc.encode_intervals([iv])
    enc.rollback()  # the pipe refused the batch: the child never saw these names
    assert enc.encode_intervals([iv]) == first
    enc.commit()
    second = enc.encode_intervals([iv, iv])
    enc.commit()
    assert b"forward-compute" in first and b"forward-compute" not in second
    assert len(second) == wire.FRAME.size + wire.COUNT.size + 2 * wire.RECORD.size
    enc.reset()  # a new child
    assert b"forward-compute" in enc.encode_intervals([iv])
