"""The collector's per-rank-step fast paths give exactly what the element-by-element paths give: the summary
arrays read from their wire bytes (``arrays.py``), a whole summary validated at once (``decode.py``), and
summaries queued per rank and spread into the window's cells at close (``Window.settle``)."""

from __future__ import annotations

import math
import random
import struct

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from test_straggler_summary import _request, _resource, _samples

import otel_straggler_schema as s
from collector_processor.otlp_values import any_value, key_value
from collector_processor.processor.straggler import arrays
from collector_processor.processor.straggler.decode import (
    REJECT_MALFORMED,
    REJECT_NON_FINITE,
    decode_request,
)
from collector_processor.processor.straggler.window import RankCell, Window

_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, -1.0, 5e-324, 1.7976931348623157e308, 12.5]


def _array(values: list[object]) -> ArrayValue:
    return ArrayValue(values=[any_value(v) for v in values])


def _same(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))


def _by_element(array: ArrayValue) -> list[float]:
    """The element-by-element reading (homogeneous arrays, as OTel requires: the first element's kind)."""
    values = array.values
    if values and values[0].WhichOneof("value") != "double_value":
        return [arrays.number(x) for x in values]
    return [x.double_value for x in values]


def test_doubles_from_the_wire_bytes_are_the_doubles_protobuf_reads() -> None:
    rng = random.Random(7)
    for n in (0, 1, 2, 13, 200):
        for _ in range(20):
            values = [rng.choice(_SPECIAL) if rng.random() < 0.3 else rng.uniform(-1e3, 1e3) for _ in range(n)]
            array = _array(values)
            got = arrays.doubles(array)
            assert len(got) == n
            assert all(_same(a, b) for a, b in zip(got, _by_element(array), strict=True))


def test_anything_but_plain_doubles_is_read_element_by_element() -> None:
    for values in ([2, 1, 5], [2.0, 1, 5.0], [1.5, "x"], ["x", 1.5], [True, 2.0], [[1.0], 2.0]):
        array = _array(values)  # type: ignore[arg-type]
        assert all(_same(a, b) for a, b in zip(arrays.doubles(array), _by_element(array), strict=True)), values
    assert list(arrays.doubles(_array([2, 1, 5]))) == [2.0, 1.0, 5.0]  # ints, converted
    # a double element carrying an unknown field is 13 bytes, not 11: read through protobuf, value kept
    odd = AnyValue(double_value=3.0)
    odd.MergeFromString(b"\x78\x01")  # field 15, varint 1
    assert list(arrays.doubles(ArrayValue(values=[AnyValue(double_value=1.0), odd]))) == [1.0, 3.0]


def test_names_and_counts_are_remembered_by_their_bytes_and_the_memo_is_bounded() -> None:
    names = _array(["forward-compute", "optimizer"])
    first = arrays.strings(names)
    assert first == ("forward-compute", "optimizer")
    assert arrays.strings(_array(["forward-compute", "optimizer"])) is first
    assert arrays.ints(_array([4, 1])) == (4, 1)
    assert arrays.strings(_array([])) == ()
    for i in range(arrays._MEMO_MAX + 5):
        assert arrays.strings(_array([f"stage-{i}"])) == (f"stage-{i}",)
    assert len(arrays._strings_memo) <= arrays._MEMO_MAX


# --- a whole summary at once -------------------------------------------------------------------------------
def _reference_decode(stages: list[str], groups: list[str], devs: list[float], hosts: list[float],
                      counts: list[int], host_total: float) -> tuple[list[tuple], dict[str, int], int]:
    """The summary's entries as the documented rules give them, one entry at a time."""
    rejected: dict[str, int] = {}
    bad_values = 0

    def reject(reason: str) -> None:
        rejected[reason] = rejected.get(reason, 0) + 1

    def ok(v: float) -> bool:
        return math.isfinite(v) and v >= 0.0

    out = []
    if ok(host_total):
        out.append((s.SPAN_RANK_STEP, "step", None, host_total, 1))
    else:
        bad_values += 1
        reject(REJECT_NON_FINITE)
    for stage, group, dev, host, count in zip(stages, groups, devs, hosts, counts, strict=True):
        if not stage:
            reject(REJECT_MALFORMED)
            continue
        d = None if dev == s.SUMMARY_NOT_MEASURED else dev
        bad = 0
        if d is not None and not ok(d):
            d, bad = None, bad + 1
        h: float | None = host
        if not ok(host):
            h, bad = None, bad + 1
        bad_values += bad
        if bad and d is None and h is None:
            reject(REJECT_NON_FINITE)
        out.append((stage, group or "other", d, h, count if count > 0 else 1))
    return out, rejected, bad_values


def _summary_span(stages: list[str], groups: list[str], devs: list[float], hosts: list[float], counts: list[int],
                  host_total: float) -> Span:
    span = Span(name=s.SPAN_RANK_STEP, span_id=b"\x01" * 8, trace_id=b"\x02" * 16)
    span.attributes.extend([
        key_value(s.ATTR_ITERATION, 7), key_value(s.ATTR_HOST_MS, host_total),
        key_value(s.ATTR_SUMMARY_STAGES, stages), key_value(s.ATTR_SUMMARY_GROUPS, groups),
        key_value(s.ATTR_SUMMARY_DEVICE_MS, devs), key_value(s.ATTR_SUMMARY_HOST_MS, hosts),
        key_value(s.ATTR_SUMMARY_COUNTS, counts)])
    return span


def test_a_summary_decodes_as_its_entries_would_one_by_one() -> None:
    rng = random.Random(11)
    for case in range(600):
        n = rng.randint(1, 14)
        # a third healthy (the fast path); the others with one kind of bad entry: values, names or counts
        bad_values, bad_names, bad_counts = (case % 6 == k for k in (1, 2, 3))
        sparse = case % 3 == 0  # some entries not measured on the device

        def value(bad: bool = bad_values, sparse: bool = sparse) -> float:
            if bad and rng.random() < 0.2:
                return rng.choice([math.nan, math.inf, -math.inf, -2.0, -0.0])
            if sparse and rng.random() < 0.5:
                return s.SUMMARY_NOT_MEASURED
            return rng.uniform(0.0, 50.0)

        stages = [("" if bad_names and rng.random() < 0.2 else f"stage-{i}") for i in range(n)]
        groups = [("" if bad_names and rng.random() < 0.2 else "forward") for _ in range(n)]
        devs = [value() for _ in range(n)]
        hosts = [value(sparse=False) for _ in range(n)]
        counts = [rng.choice([4, 1, 0, -3]) if bad_counts else rng.choice([4, 1]) for _ in range(n)]
        host_total = value(sparse=False)
        res = decode_request(_request((s.SCOPE_STEP_NAME, [_summary_span(stages, groups, devs, hosts, counts,
                                                                          host_total)])).resource_spans)
        want, rejected, bad_values = _reference_decode(stages, groups, devs, hosts, counts, host_total)
        (summ,) = res.summaries
        got = list(zip(summ.stages, summ.groups, summ.device_ms, summ.host_ms, summ.counts, strict=True))
        assert len(got) == len(want), case
        for g, w in zip(got, want, strict=True):
            assert g[:2] == w[:2] and g[4] == w[4], case
            for a, b in ((g[2], w[2]), (g[3], w[3])):
                assert (a is None and b is None) or (a is not None and b is not None and _same(a, b)), case
        assert res.rejected == rejected and res.non_finite_values == bad_values, case
        assert res.stage_spans == 1 + n


def test_the_fast_path_keeps_the_stage_span_equivalence() -> None:
    """A healthy summary (all arrays clean) through the fast path, as samples."""
    res = decode_request(_request((s.SCOPE_STEP_NAME, [_summary_span(
        ["forward-compute", "optimizer"], ["forward", "optimizer"], [20.0, s.SUMMARY_NOT_MEASURED], [2.0, 3.0],
        [4, 1], 30.0)])).resource_spans)
    by_stage = {x.stage: x for x in _samples(res)}
    assert by_stage["forward-compute"].device_ms == 20.0 and by_stage["optimizer"].device_ms is None
    assert by_stage["optimizer"].host_ms == 3.0 and by_stage[s.SPAN_RANK_STEP].host_ms == 30.0
    assert res.rejected == {} and res.non_finite_values == 0
    assert _resource().attributes  # the shared helper's resource carries rank and cohort


# --- queued summaries spread at close ---------------------------------------------------------------------
def _add_one_by_one(w: Window, rank: int, stages: list[str], step: int, tokens: int | None,
                    dev: list[float | None], host: list[float | None]) -> None:
    """The reference for queued summaries: every entry straight into its cell, in order."""
    for i, stage in enumerate(stages):
        cell = w.cell(stage, rank)
        if dev[i] is None and host[i] is None:
            continue
        if dev[i] is not None:
            cell.dev.append(dev[i])  # type: ignore[arg-type]
            cell.dev_steps.append(step)
        if host[i] is not None:
            cell.host.append(host[i])  # type: ignore[arg-type]
        if tokens is not None:
            cell.tokens.append(tokens)


def _cells(w: Window) -> list[tuple[str, list[tuple[int, RankCell]]]]:
    return [(stage, list(ranks.items())) for stage, ranks in w.cells.items()]  # dict order included


def test_queued_summaries_settle_into_the_cells_entries_one_by_one_would_give() -> None:
    rng = random.Random(5)
    layouts = [[f"s{i}" for i in range(6)], ["s0", "s2", "x", "s1"], ["y", "s3"]]
    for case in range(300):
        queued = Window("step", 0, 0.0, 0, 4)
        direct = Window("step", 0, 0.0, 0, 4)
        for _ in range(rng.randint(1, 40)):
            rank = rng.randrange(5)
            if rng.random() < 0.05:  # a stage span of the same window (the schema-1 path) in between
                for w in (queued, direct):
                    w.cell("s1", rank).host.append(1.0)
                continue
            stages = rng.choice(layouts) if rng.random() < 0.2 else layouts[rank % 2]
            step = rng.randrange(5)
            tokens = rng.choice([None, 100, 200])
            dev = [None if rng.random() < 0.3 else rng.uniform(1, 9) for _ in stages]
            host = [None if rng.random() < 0.2 else rng.uniform(1, 9) for _ in stages]
            queued.queue_summary(rank, stages, step, tokens, dev, host)
            _add_one_by_one(direct, rank, stages, step, tokens, dev, host)
        queued.settle()
        assert _cells(queued) == _cells(direct), case
        assert queued.ranks() == direct.ranks()


def test_an_absurd_finite_duration_is_dropped_and_counted() -> None:
    """1e308 ms is finite but would overflow the cost arithmetic (+Inf on /metrics): the summary's fast path
    and its per-entry path both drop it as non_finite, and a value at the bound is kept."""
    from collector_processor.processor.straggler.decode import MAX_DURATION_MS

    res = decode_request(_request((s.SCOPE_STEP_NAME, [_summary_span(
        ["forward-compute", "backward-compute"], ["forward", "backward"], [1e308, MAX_DURATION_MS], [2.0, 1e308],
        [1, 1], 30.0)])).resource_spans)
    by_stage = {x.stage: x for x in _samples(res)}
    assert by_stage["forward-compute"].device_ms is None and by_stage["forward-compute"].host_ms == 2.0
    assert by_stage["backward-compute"].device_ms == MAX_DURATION_MS and by_stage["backward-compute"].host_ms is None
    assert res.non_finite_values == 2
