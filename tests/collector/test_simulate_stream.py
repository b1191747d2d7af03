"""The simulator's noise model: step time jitter common to a step's ranks (``Noise.step_jitter``); its encoding:
the OTel SDK exporter's for the same spans."""

from __future__ import annotations

import statistics

from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

import otel_straggler_schema as s
from jobsim.faults import COMPUTE_STAGES, Fault
from jobsim.job import Layout
from jobsim.load import LoadConfig, sdk_requests
from jobsim.stream import JobStream, Noise, SimConfig


def _forward_ms(noise: Noise, steps: int = 200) -> dict[int, dict[int, float]]:
    """step -> rank -> forward-compute device ms, from the stage spans the simulator sends."""
    out: dict[int, dict[int, float]] = {}
    stream = JobStream(SimConfig(steps=steps, noise=noise, step_summary=False, seed=4), [])
    for step, req in stream:
        for rs in req.resource_spans:
            rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
            for sp in rs.scope_spans[0].spans:
                attrs = {a.key: a.value for a in sp.attributes}
                if attrs.get(s.ATTR_STAGE) is not None and attrs[s.ATTR_STAGE].string_value == "forward-compute":
                    out.setdefault(step, {})[rank] = attrs[s.ATTR_DEVICE_MS].double_value
    return out


_QUIET = {"spike_prob": 0.0, "warmup_steps": 0, "late_ranks": 0, "missing_prob": 0.0}


def test_step_jitter_moves_every_rank_of_a_step_alike() -> None:
    got = _forward_ms(Noise(jitter=0.0, step_jitter=0.02, **_QUIET))
    per_step = []
    for ranks in got.values():
        vals = list(ranks.values())
        assert len(vals) >= 4 and max(vals) - min(vals) < 1e-9  # no per-rank noise: all ranks equal
        per_step.append(vals[0])
    rel = statistics.pstdev(per_step) / statistics.mean(per_step)
    assert 0.016 < rel < 0.024  # the step time jitters by ~2 %


def test_step_jitter_leaves_the_ranks_per_step_ratios_alone() -> None:
    plain = _forward_ms(Noise(jitter=0.01, **_QUIET))
    common = _forward_ms(Noise(jitter=0.01, step_jitter=0.02, **_QUIET))
    assert plain.keys() == common.keys()
    moved = 0
    for step, ranks in plain.items():
        c = common[step]
        moved += abs(c[0] / ranks[0] - 1.0) > 1e-6
        for r, v in ranks.items():  # same per-rank draws; one factor per step on all of them
            assert abs(c[r] / c[0] - v / ranks[0]) < 1e-9
    assert moved > len(plain) * 0.9


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    return tuple(_value(x) for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)


def _sdk_encoding(req: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """The same spans as the SDK's ``ReadableSpan``s, encoded by its OTLP exporter's encoder, less the two fields
    the simulator leaves unset on every span (the SDK's ``flags``: the parent is remote; an empty ``status``)."""
    spans = []
    for rs in req.resource_spans:
        resource = Resource({kv.key: _value(kv.value) for kv in rs.resource.attributes})
        for ss in rs.scope_spans:
            scope = InstrumentationScope(ss.scope.name)
            for sp in ss.spans:
                tid = int.from_bytes(sp.trace_id, "big")
                spans.append(ReadableSpan(
                    name=sp.name, context=SpanContext(tid, int.from_bytes(sp.span_id, "big"), False, TraceFlags(1)),
                    parent=SpanContext(tid, int.from_bytes(sp.parent_span_id, "big"), True, TraceFlags(1)),
                    resource=resource, attributes={kv.key: _value(kv.value) for kv in sp.attributes},
                    kind=SpanKind.INTERNAL, start_time=sp.start_time_unix_nano, end_time=sp.end_time_unix_nano,
                    instrumentation_scope=scope))
    out = encode_spans(spans)
    for rs in out.resource_spans:
        for ss in rs.scope_spans:
            for sp in ss.spans:
                assert sp.flags == 0x300 and not sp.status.code and not sp.status.message
                sp.ClearField("flags")
                sp.ClearField("status")
    return out


def test_the_stream_is_what_the_sdk_exporter_encodes() -> None:
    """(Compared as bytes: a step without device time has NaN in its summary.)"""
    cfg = SimConfig(layout=Layout(tp=2, dp=4), steps=6, ddp=True, collective_marked=True, nvml=True, device_every=2,
                    noise=Noise(late_ranks=0))
    for _step, req in JobStream(cfg, [Fault("device", 3, COMPUTE_STAGES, 0.1, 2)]):
        assert len(req.resource_spans) == 8
        assert _sdk_encoding(req).SerializeToString(deterministic=True) == req.SerializeToString(deterministic=True)


def test_the_load_is_what_the_sdk_exporter_encodes() -> None:
    """The load's hand-made wire bytes (``jobsim/load.py``, made fast for the scale benches) decode to the message
    the SDK's encoder makes of the same spans."""
    cfg = LoadConfig(layout=Layout(dp=2), device_every=2, spans_per_request=40)
    n = 0
    for raw in sdk_requests(cfg, range(1, 4)):
        req = ExportTraceServiceRequest.FromString(raw)  # (its fields in another order than protobuf's: decoded)
        assert _sdk_encoding(req).SerializeToString(deterministic=True) == req.SerializeToString(deterministic=True)
        n += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    assert n == 2 * 3 * cfg.spans_per_rank_step
