"""The rank-step decoder's shortcuts (``decode.py``: attributes looked up in one dict, arrays read from each
attribute's wire bytes, resource identities remembered by the resource's bytes) give exactly what the plain
per-field reading gives: the reference below is that reading, field by field through protobuf. Random spans,
healthy and broken (bad values, not-measured entries, ints for doubles, missing, duplicate and foreign
attributes, any order, unknown fields), must decode to the same ``DecodeResult`` down to the float bits."""

from __future__ import annotations

import math
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span, Status

import otel_straggler_schema as s
from collector_processor import resource_identity
from collector_processor.processor.straggler import arrays, decode, hints
from collector_processor.processor.straggler.decode import (
    REJECT_MALFORMED,
    REJECT_NON_FINITE,
    DecodeResult,
    ResourceIdentity,
)
from collector_processor.processor.straggler.model import StepSummary

EXACT = settings(max_examples=600, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


# --- the reference: every attribute through protobuf, compared key by key ----------------------------------
def _reference_summary(span: Span, ident: ResourceIdentity, out: DecodeResult) -> None:
    step = None
    host_total = None
    tokens = None
    stages = groups = devs = hosts = counts = None
    collective: tuple[str, ...] = ()
    gpu: dict[str, object] | None = None
    for kv in span.attributes:
        k = kv.key
        if k == s.ATTR_SUMMARY_DEVICE_MS:
            devs = arrays.doubles(kv.value.array_value)
        elif k == s.ATTR_SUMMARY_HOST_MS:
            hosts = arrays.doubles(kv.value.array_value)
        elif k == s.ATTR_SUMMARY_STAGES:
            stages = arrays.strings(kv.value.array_value)
        elif k == s.ATTR_SUMMARY_GROUPS:
            groups = arrays.strings(kv.value.array_value)
        elif k == s.ATTR_SUMMARY_COUNTS:
            counts = arrays.ints(kv.value.array_value)
        elif k == s.ATTR_ITERATION:
            step = kv.value.int_value
        elif k == s.ATTR_HOST_MS:
            host_total = arrays.number(kv.value)
        elif k == s.ATTR_WORKLOAD_TOKENS:
            t = kv.value.int_value
            tokens = t if t > 0 else None
        elif k == s.ATTR_SUMMARY_COLLECTIVE:
            collective = arrays.strings(kv.value.array_value)
        elif k in hints.KEYS:
            if gpu is None:
                gpu = {}
            kind = hints.KEYS[k]
            gpu[k] = (arrays.strings(kv.value.array_value) if kind == "strings"
                      else kv.value.int_value if kind == "int" else arrays.number(kv.value))
    if stages is None:
        return
    n = len(stages)
    out.stage_spans += 1
    if (not ident.usable or step is None or groups is None or devs is None or hosts is None or counts is None
            or not (len(groups) == len(devs) == len(hosts) == len(counts) == n)):
        out.reject(REJECT_MALFORMED)
        return
    out.stage_spans += n
    host_ok = host_total is not None and math.isfinite(host_total) and host_total >= 0.0
    if not host_ok:
        if host_total is None:
            out.reject(REJECT_MALFORMED)
        else:
            out.non_finite_values += 1
            out.reject(REJECT_NON_FINITE)
    names: list[str] = [s.SPAN_RANK_STEP] if host_ok else []
    grps = ["step"] if host_ok else []
    dev_out: list[float | None] = [None] if host_ok else []
    host_out: list[float | None] = [host_total] if host_ok else []
    cnt = [1] if host_ok else []
    for i, stage in enumerate(stages):
        if not stage:
            out.reject(REJECT_MALFORMED)
            continue
        dev, host_ms = decode._clean(None if devs[i] == s.SUMMARY_NOT_MEASURED else devs[i], hosts[i], out)
        names.append(stage)
        grps.append(groups[i] or "other")
        dev_out.append(dev)
        host_out.append(host_ms)
        cnt.append(counts[i] if counts[i] > 0 else 1)
    out.summaries.append(StepSummary(
        ident.job, ident.cohort, ident.rank, ident.host, ident.gpu, ident.world_size, ident.dp_size, step, tokens,
        span.start_time_unix_nano, span.end_time_unix_nano, span.trace_id, span.span_id,
        names, grps, dev_out, host_out, cnt, collective, ident.dp_rank, gpu))


def _bits(x: object) -> object:
    """A decoded value with every float as its bits (-0.0 is not 0.0) and every sequence typed."""
    if isinstance(x, float):
        return ("f", struct.pack("<d", x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_bits(v) for v in x])
    if isinstance(x, dict):
        return ("d", [(k, _bits(v)) for k, v in x.items()])
    if isinstance(x, StepSummary):
        return ("S", [(f, _bits(getattr(x, f))) for f in StepSummary.__slots__])  # type: ignore[attr-defined]
    return x


def _result(res: DecodeResult) -> object:
    return (_bits(res.samples), _bits(res.summaries), list(res.rejected.items()), res.non_finite_values,
            res.stage_spans)


# --- random spans --------------------------------------------------------------------------------------
_DOUBLES = st.one_of(
    st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, -1.0, -2.5, s.SUMMARY_NOT_MEASURED, 5e-324,
                     1e308, decode.MAX_DURATION_MS, math.nextafter(decode.MAX_DURATION_MS, math.inf), 12.5]),
    st.floats(min_value=0.0, max_value=500.0),
    st.floats(allow_nan=True, allow_infinity=True))
_INTS = st.one_of(st.sampled_from([0, 1, -1, 4, 127, 128, 2**31, 2**50, -(2**63), 2**63 - 1]), st.integers(-5, 300))
_NAMES = st.sampled_from(["forward-compute", "backward-compute", "optimizer", "", "forward", "data", "x" * 130,
                          "7-chars",
                          "émoji-☃"])
_UNKNOWN = st.sampled_from([b"", b"", b"", b"\x78\x01", b"\xa2\x06\x01z"])  # field 15 varint, field 100 bytes


def _with_unknown(msg: object, extra: bytes) -> object:
    if extra:
        msg.MergeFromString(extra)  # type: ignore[attr-defined]
    return msg


@st.composite
def _any_value(draw: st.DrawFn, kind: str | None = None) -> AnyValue:
    kind = kind or draw(st.sampled_from(["double", "int", "string", "bool", "doubles", "ints", "strings",
                                         "mixed", "empty_array", "unset", "bytes"]))
    if kind == "double":
        v = AnyValue(double_value=draw(_DOUBLES))
    elif kind == "int":
        v = AnyValue(int_value=draw(_INTS))
    elif kind == "string":
        v = AnyValue(string_value=draw(_NAMES))
    elif kind == "bool":
        v = AnyValue(bool_value=draw(st.booleans()))
    elif kind == "bytes":
        v = AnyValue(bytes_value=b"\x01\x02")
    elif kind == "unset":
        v = AnyValue()
    elif kind == "empty_array":
        v = AnyValue(array_value=ArrayValue())
    else:
        element = {"doubles": "double", "ints": "int", "strings": "string"}.get(kind)
        values = draw(st.lists(_any_value(element) if element else _any_value(), max_size=6))
        for x in values:
            _with_unknown(x, draw(_UNKNOWN))
        v = AnyValue(array_value=_with_unknown(ArrayValue(values=values), draw(_UNKNOWN)))  # type: ignore[arg-type]
    return _with_unknown(v, draw(_UNKNOWN))  # type: ignore[return-value]


def _array(values: list[object], kind: str) -> AnyValue:
    if kind == "double":
        return AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=v) for v in values]))  # type: ignore[arg-type]
    if kind == "int":
        return AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=v) for v in values]))  # type: ignore[arg-type]
    return AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v) for v in values]))  # type: ignore[arg-type]


_KEYS = [s.ATTR_SUMMARY_STAGES, s.ATTR_SUMMARY_GROUPS, s.ATTR_SUMMARY_DEVICE_MS, s.ATTR_SUMMARY_HOST_MS,
         s.ATTR_SUMMARY_COUNTS, s.ATTR_ITERATION, s.ATTR_HOST_MS, s.ATTR_WORKLOAD_TOKENS, s.ATTR_SUMMARY_COLLECTIVE,
         *hints.KEYS, s.ATTR_STAGE, s.ATTR_STAGE_GROUP, "other.key"]


@st.composite
def summary_spans(draw: st.DrawFn) -> Span:
    """A rank-step span: mostly a coherent summary of n entries (each array possibly off by one, of the wrong
    kind, or missing), plus foreign, duplicate and malformed attributes, in any order."""
    n = draw(st.integers(0, 14))
    healthy = draw(st.booleans())
    value = (st.floats(min_value=0.0, max_value=200.0) if healthy
             else st.one_of(_DOUBLES, st.just(s.SUMMARY_NOT_MEASURED)))
    dev = st.one_of(value, st.just(s.SUMMARY_NOT_MEASURED))

    def size() -> int:
        return n if healthy or draw(st.integers(0, 9)) else max(0, n + draw(st.sampled_from([-1, 1])))

    attrs: list[KeyValue] = []
    for key, kind, element in ((s.ATTR_SUMMARY_STAGES, "string", _NAMES), (s.ATTR_SUMMARY_GROUPS, "string", _NAMES),
                               (s.ATTR_SUMMARY_DEVICE_MS, "double", dev), (s.ATTR_SUMMARY_HOST_MS, "double", value),
                               (s.ATTR_SUMMARY_COUNTS, "int", st.integers(-2, 9) if not healthy
                                else st.integers(1, 9))):
        if not healthy and not draw(st.integers(0, 14)):
            continue  # missing
        if healthy and kind == "string":
            element = st.sampled_from(["forward-compute", "optimizer", "data", "x" * 130])
        values = [draw(element) for _ in range(size())]
        if kind == "double" and values and draw(st.integers(0, 7)) == 0:
            # ints given for doubles
            av = _array([int(v) if math.isfinite(v) and abs(v) < 2**62 else 3 for v in values], "int")
        else:
            av = _array(values, kind)
        attrs.append(KeyValue(key=key, value=av))
    attrs.append(KeyValue(key=s.ATTR_ITERATION, value=AnyValue(int_value=draw(
        st.one_of(st.integers(0, 2**21), _INTS)))))
    attrs.append(KeyValue(key=s.ATTR_HOST_MS, value=AnyValue(double_value=draw(value))))
    if draw(st.booleans()):
        attrs.append(KeyValue(key=s.ATTR_WORKLOAD_TOKENS, value=AnyValue(int_value=draw(_INTS))))
    if draw(st.booleans()):
        attrs.append(KeyValue(key=s.ATTR_STAGE, value=AnyValue(string_value=s.SPAN_RANK_STEP)))
    if draw(st.integers(0, 3)) == 0:
        attrs.append(KeyValue(key=s.ATTR_SUMMARY_COLLECTIVE, value=_array(["optimizer"], "string")))
    if not healthy or draw(st.integers(0, 3)) == 0:  # foreign, duplicate, hint or odd-kind attributes
        for _ in range(draw(st.integers(0, 4))):
            attrs.append(KeyValue(key=draw(st.sampled_from(_KEYS)), value=draw(_any_value())))
    if not healthy:
        for a in attrs:
            _with_unknown(a, draw(_UNKNOWN))
    order = draw(st.permutations(range(len(attrs)))) if draw(st.booleans()) else range(len(attrs))
    span = Span(name=s.SPAN_RANK_STEP, trace_id=draw(st.sampled_from([b"\x02" * 16, b"", b"\x07" * 15])),
                span_id=draw(st.sampled_from([b"\x01" * 8, b"\x00" * 8, b""])),
                parent_span_id=draw(st.sampled_from([b"", b"\x03" * 8])),
                start_time_unix_nano=draw(st.sampled_from([0, 1, 1_700_000_000_000_000_000])),
                end_time_unix_nano=draw(st.sampled_from([0, 2**64 - 1, 1_700_000_000_030_000_000])),
                attributes=[attrs[i] for i in order])
    if draw(st.integers(0, 5)) == 0:
        span.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="boom"))
    return _with_unknown(span, draw(_UNKNOWN))  # type: ignore[return-value]


_IDENTS = st.sampled_from([ResourceIdentity("j", "c@r", "r", 3, "h", "g", 8, 4, 1, "svc", True),
                           ResourceIdentity(cohort="c", rank=0),
                           ResourceIdentity(cohort="", rank=5),
                           ResourceIdentity(cohort="c", rank=-1)])


@EXACT
@given(spans=st.lists(summary_spans(), min_size=1, max_size=3), ident=_IDENTS)
def test_a_summary_decodes_as_the_per_field_reading_does(spans: list[Span], ident: ResourceIdentity) -> None:
    got, want = DecodeResult(), DecodeResult()
    for span in spans:
        decode._decode_summary(span, ident, got)
        _reference_summary(span, ident, want)
    assert _result(got) == _result(want)


def test_the_generator_reaches_both_summary_paths_and_every_outcome() -> None:
    """The property above is worth what its spans exercise: healthy ones (whole lists at once), broken
    ones (entry by entry) and every rejection."""
    seen: dict[str, int] = {}
    whole = 0

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(span=summary_spans())
    def run(span: Span) -> None:
        nonlocal whole
        res = DecodeResult()
        _reference_summary(span, ResourceIdentity(cohort="c", rank=0), res)
        for k, v in res.rejected.items():
            seen[k] = seen.get(k, 0) + v
        whole += bool(res.summaries) and not res.rejected and res.non_finite_values == 0

    run()
    assert seen.get(REJECT_MALFORMED) and seen.get(REJECT_NON_FINITE) and whole > 50


# --- attribute readers and resource identities -----------------------------------------------------------
@EXACT
@given(value=_any_value(), extra=_UNKNOWN,
       key=st.sampled_from([s.ATTR_SUMMARY_DEVICE_MS, s.ATTR_SUMMARY_HOST_MS, "k", "x" * 200]))
def test_attribute_readers_read_what_the_array_readers_read(value: AnyValue, extra: bytes, key: str) -> None:
    kv = _with_unknown(KeyValue(key=key, value=value), extra)
    array = kv.value.array_value  # type: ignore[attr-defined]
    assert _bits(arrays.attribute_doubles(kv, key)) == _bits(arrays.doubles(array))  # type: ignore[arg-type]
    assert arrays.attribute_strings(kv) == arrays.strings(array)  # type: ignore[arg-type]
    assert arrays.attribute_ints(kv) == arrays.ints(array)  # type: ignore[arg-type]


def test_a_long_array_of_doubles_is_read_from_the_attribute_bytes() -> None:
    """Lengths whose varints take two and three bytes (the layout's prefix grows with them)."""
    for n in (0, 1, 11, 12, 1200):
        values = [float(i) * 0.5 for i in range(n)]
        kv = KeyValue(key=s.ATTR_SUMMARY_DEVICE_MS, value=_array(values, "double"))
        got = arrays.attribute_doubles(kv, s.ATTR_SUMMARY_DEVICE_MS)
        assert type(got) is tuple and list(got) == values  # the wire path (doubles' fallback gives a list)


def test_attribute_memos_are_bounded() -> None:
    for i in range(arrays._MEMO_MAX + 5):
        kv = KeyValue(key="k", value=_array([f"stage-{i}"], "string"))
        assert arrays.attribute_strings(kv) == (f"stage-{i}",)
        kv = KeyValue(key="k", value=_array([i], "int"))
        assert arrays.attribute_ints(kv) == (i,)
        kv = KeyValue(key=f"k{i}", value=_array([1.0], "double"))
        assert arrays.attribute_doubles(kv, f"k{i}") == (1.0,)
    for memo in (arrays._attr_strings_memo, arrays._attr_ints_memo, arrays._attr_layouts):
        assert 0 < len(memo) <= arrays._MEMO_MAX


_RES_KEYS = [*s.RES_IDENTITY_KEYS, "other"]


@EXACT
@given(attrs=st.lists(st.tuples(st.sampled_from(_RES_KEYS), _any_value()), max_size=8))
def test_a_remembered_resource_identity_is_the_one_read_field_by_field(attrs: list[tuple[str, AnyValue]]) -> None:
    rs = ResourceSpans(resource=Resource(attributes=[KeyValue(key=k, value=v) for k, v in attrs]))
    want = decode.resource_identity(rs)
    assert resource_identity.identity(rs.resource) == want
    assert resource_identity.identity(rs.resource) == want  # remembered
    named = [k for k, _ in attrs]
    doubled = [k for i, k in enumerate(named) if k != "other" and k in named[:i]]
    assert want.duplicate == (doubled[0] if doubled else "")
    assert not (want.duplicate and want.usable)


def test_the_identity_memo_is_bounded() -> None:
    for i in range(resource_identity._IDENTITY_MAX + 5):
        res = Resource(attributes=[KeyValue(key=s.RES_RANK, value=AnyValue(int_value=i))])
        assert resource_identity.identity(res).rank == i
    assert 0 < len(resource_identity._identities) <= resource_identity._IDENTITY_MAX


def test_large_or_ever_new_arrays_and_resources_are_not_remembered() -> None:
    """What the memos keep is bounded in bytes, not only in entries: a sender of ever-new large arrays (names,
    counts, doubles) or large resources gets them read correctly every time and leaves nothing behind."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

    from collector_processor.processor.straggler import arrays

    memos = (arrays._strings_memo, arrays._ints_memo, arrays._attr_strings_memo, arrays._attr_ints_memo,
             arrays._unpackers, arrays._attr_layouts, resource_identity._identities)
    for m in memos:
        m.clear()
    for i in range(20):
        names = ArrayValue(values=[AnyValue(string_value=f"stage-{i}-{j}" * 8) for j in range(64)])
        assert len(names.SerializeToString()) > arrays.MEMO_KEY_BYTES
        assert arrays.strings(names)[5] == f"stage-{i}-5" * 8
        kv = KeyValue(key="k", value=AnyValue(array_value=names))
        assert arrays.attribute_strings(kv)[-1] == f"stage-{i}-63" * 8
        counts = ArrayValue(values=[AnyValue(int_value=i + j) for j in range(1000)])
        assert arrays.ints(counts)[999] == i + 999
        assert arrays.attribute_ints(KeyValue(key="k", value=AnyValue(array_value=counts)))[0] == i
        n = arrays.UNPACKER_MAX_ELEMENTS + 1 + i
        dbl = ArrayValue(values=[AnyValue(double_value=float(i + j)) for j in range(n)])
        assert list(arrays.doubles(dbl))[-1] == float(i + n - 1)
        assert arrays.attribute_doubles(KeyValue(key="d", value=AnyValue(array_value=dbl)), "d")[0] == i
        res = ResourceSpans(resource=Resource(attributes=[
            KeyValue(key="straggler.rank", value=AnyValue(int_value=i)),
            KeyValue(key="pad", value=AnyValue(string_value="x" * 4096))]))
        resource_identity.identity(res.resource)
    assert all(len(m) == 0 for m in memos), [len(m) for m in memos]


def test_a_resource_naming_an_identity_attribute_twice_gives_no_sample() -> None:
    """Refused by the receivers; a pipeline fed in process rejects its spans as ``malformed``, whichever value of
    the doubled attribute a reader would have taken."""
    rs = ResourceSpans(resource=Resource(attributes=[
        KeyValue(key=s.RES_RANK, value=AnyValue(int_value=3)),
        KeyValue(key=s.RES_COHORT_KEY, value=AnyValue(string_value="c")),
        KeyValue(key=s.RES_JOB_ID, value=AnyValue(string_value="job-a")),
        KeyValue(key=s.RES_JOB_ID, value=AnyValue(string_value="job-b"))]))
    span = rs.scope_spans.add().spans.add(name="forward-compute")
    span.attributes.add(key=s.ATTR_STAGE, value=AnyValue(string_value="forward-compute"))
    span.attributes.add(key=s.ATTR_ITERATION, value=AnyValue(int_value=1))
    span.attributes.add(key=s.ATTR_HOST_MS, value=AnyValue(double_value=5.0))
    out = DecodeResult()
    decode.decode_resource_spans(rs, out)
    assert out.samples == [] and out.rejected == {REJECT_MALFORMED: 1}
    del rs.resource.attributes[-1]
    out = DecodeResult()
    decode.decode_resource_spans(rs, out)
    assert len(out.samples) == 1 and out.rejected == {}
