"""Load for throughput and scale benches: OTLP requests as the ranks' SDKs batch them.

Each rank's exporter (BatchSpanProcessor) sends requests of up to 512 spans of its own resource, so a request
holds one ``ResourceSpans`` (one rank) with that rank's next spans in step order. Per rank-step: per
microbatch forward-compute, backward-compute, batch-generator and two p2p stages (stage scope), then the
step's collectives and optimizer stages and the ``rank-step`` span with the step summary (step scope;
``spans_per_rank_step`` in all, ~50 by default). Requests are round-robin over ranks, so all ranks advance
together as real exporters do.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import otel_straggler_schema as s
from jobsim.job import Layout, ranks_of, timers
from jobsim.stream import SimConfig, resource_for
from otel_straggler_schema.stages import stage_group

SDK_BATCH = 512

# (stage, level, device ms) per microbatch, then per step; the group is the emitter's (stages.stage_group)
_PER_MICROBATCH = (("batch-generator", 2, 0.4), ("forward-compute", 2, 6.0), ("backward-compute", 2, 12.0),
                   ("forward-send", 2, 0.8), ("backward-recv", 2, 0.9))
_PER_STEP = (("all-grads-sync", 1, 18.0), ("params-all-gather", 1, 6.0), ("optimizer", 1, 14.0),
             ("optimizer-inner-step", 1, 12.0), ("optimizer-copy-main-to-model-params", 1, 1.5),
             ("optimizer-clip-main-grad", 1, 2.0), ("optimizer-count-zeros", 1, 0.3), ("forward-backward", 1, 170.0))
timers(*(name for name, _level, _ms in _PER_MICROBATCH + _PER_STEP))


@dataclass
class LoadConfig:
    layout: Layout
    microbatches: int = 8
    # interval: one span per microbatch interval (~50 per rank-step); step: one per timer per step (the
    # emitter's default detail, 14 per rank-step)
    detail: str = s.DETAIL_INTERVAL
    step_s: float = 5.0
    device_every: int = 1
    job: str = "load-job"
    seed: int = 0
    spans_per_request: int = SDK_BATCH
    # one slow rank: ``slow_stage`` device (and host) time x ``slow_factor`` from step ``slow_from`` on
    slow_rank: int | None = None
    slow_factor: float = 1.0
    slow_from: int = 0
    slow_stage: str = "forward-compute"

    @property
    def spans_per_rank_step(self) -> int:
        per_mb = self.microbatches if self.detail == s.DETAIL_INTERVAL else 1
        return per_mb * len(_PER_MICROBATCH) + len(_PER_STEP) + 1


def varint(n: int) -> bytes:
    """A protobuf base-128 varint (non-negative ``n``)."""
    if n < _SMALL:
        return _VARINTS[n]
    return _varint(n)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_SMALL = 1 << 14  # every tag and length of the load's messages: encoded once
_VARINTS = [_varint(n) for n in range(_SMALL)]


def length_delimited(field: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def _kv_bytes(key: str, value: object) -> bytes:
    """A span attribute (Span.attributes = 9) as wire bytes: KeyValue{key = 1, value = 2: AnyValue}."""
    if isinstance(value, int):
        any_value = b"\x18" + varint(value)  # int_value = 3 (non-negative here)
    elif isinstance(value, float):
        any_value = b"\x21" + _F64.pack(value)  # double_value = 4
    else:
        any_value = length_delimited(1, str(value).encode())  # string_value = 1
    return length_delimited(9, length_delimited(1, key.encode()) + length_delimited(2, any_value))


_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")


def _array_kv_bytes(key: str, values: list) -> bytes:
    """An array attribute: AnyValue.array_value = 5: ArrayValue{values = 1: AnyValue}."""
    items = []
    for v in values:
        if isinstance(v, int):
            items.append(length_delimited(1, b"\x18" + varint(v)))
        elif isinstance(v, float):
            items.append(length_delimited(1, b"\x21" + _F64.pack(v)))
        else:
            items.append(length_delimited(1, length_delimited(1, str(v).encode())))
    array = length_delimited(5, b"".join(items))  # AnyValue.array_value = 5
    return length_delimited(9, length_delimited(1, key.encode()) + length_delimited(2, array))


def _rank_spans(cfg: LoadConfig, rank: int, steps: range, rng: random.Random) -> Iterator[tuple[bool, bytes]]:
    """One rank's spans in step order, each as (step scope?, the bytes of a ``ScopeSpans.spans`` entry)
    (values: nominal x Gaussian 1 % noise). Encoded from per-stage templates: the protobuf object path is
    too slow to build the 16k-rank scale load."""
    step_ns = int(cfg.step_s * 1e9)
    t_base = 1_800_000_000_000_000_000
    per_span = cfg.microbatches if cfg.detail != s.DETAIL_INTERVAL else 1  # intervals summed into one span
    stages = [(name, level, ms * per_span) for _ in range(cfg.microbatches // per_span)
              for name, level, ms in _PER_MICROBATCH] + list(_PER_STEP)
    count_of = {name: (per_span if any(name == m[0] for m in _PER_MICROBATCH) else 1) for name, _l, _m in stages}
    const = {name: (length_delimited(5, name.encode()) + b"\x30\x01"  # name = 5, kind = 6 (INTERNAL)
                    + _kv_bytes(s.ATTR_STAGE, name) + _kv_bytes(s.ATTR_STAGE_GROUP, stage_group(name))
                    + _kv_bytes(s.ATTR_STAGE_LEVEL, level) + _kv_bytes(s.ATTR_COUNT, count_of[name])
                    + _kv_bytes(s.ATTR_DETAIL, cfg.detail) + _kv_bytes(s.ATTR_WORKLOAD_TOKENS, 32768))
             for name, level, _ms in stages}
    meas_dev = _kv_bytes(s.ATTR_MEASUREMENT, s.MEASUREMENT_DEVICE)
    meas_host = _kv_bytes(s.ATTR_MEASUREMENT, s.MEASUREMENT_HOST_ONLY)
    k_host = length_delimited(1, s.ATTR_HOST_MS.encode())
    k_dev = length_delimited(1, s.ATTR_DEVICE_MS.encode())
    rank_step_const = (length_delimited(5, s.SPAN_RANK_STEP.encode()) + b"\x30\x01"
                       + _kv_bytes(s.ATTR_STAGE, s.SPAN_RANK_STEP)
                       + _kv_bytes(s.ATTR_STAGE_GROUP, "step"))

    def dbl(key: bytes, v: float) -> bytes:
        return b"\x4a" + varint(len(key) + 11) + key + b"\x12\x09\x21" + _F64.pack(v)

    block = s.trace_block(rank)
    for step in steps:
        tid = s.trace_id_for_step(cfg.job, step, block=block)
        trace = b"\x0a\x10" + tid.to_bytes(16, "big")
        parent_id = s.rank_step_span_id(cfg.job, step, rank).to_bytes(8, "big")
        parent = b"\x22\x08" + parent_id
        it = _kv_bytes(s.ATTR_ITERATION, step)
        t = t_base + step * step_ns
        measured = step % cfg.device_every == 0
        summary: dict[str, list] = {}  # name -> [group, device ms, host ms, count], the emitter's aggregation
        slow = rank == cfg.slow_rank and step >= cfg.slow_from
        for name, _level, ms in stages:
            dev = ms * (1.0 + rng.gauss(0.0, 0.01)) * (cfg.slow_factor if slow and name == cfg.slow_stage else 1.0)
            d = int(dev * 1e6)
            body = (trace + b"\x12\x08" + rng.getrandbits(64).to_bytes(8, "big") + parent + const[name]
                    + b"\x39" + _U64.pack(t) + b"\x41" + _U64.pack(t + d) + it + dbl(k_host, dev * 0.3)
                    + ((dbl(k_dev, dev) + meas_dev) if measured else meas_host))
            yield False, b"\x12" + varint(len(body)) + body
            t += d
            e = summary.get(name)
            if e is None:
                summary[name] = [stage_group(name), dev, dev * 0.3, count_of[name]]
            else:
                e[1] += dev
                e[2] += dev * 0.3
                e[3] += count_of[name]
        t0 = t_base + step * step_ns
        entries = list(summary.items())
        body = (trace + b"\x12\x08" + parent_id + b"\x22\x08"
                + s.step_root_span_id(tid).to_bytes(8, "big") + rank_step_const
                + b"\x39" + _U64.pack(t0) + b"\x41" + _U64.pack(t) + it + dbl(k_host, (t - t0) / 1e6)
                + _kv_bytes(s.ATTR_WORKLOAD_TOKENS, 32768 * cfg.microbatches)
                + _array_kv_bytes(s.ATTR_SUMMARY_STAGES, [n for n, _ in entries])
                + _array_kv_bytes(s.ATTR_SUMMARY_GROUPS, [e[0] for _, e in entries])
                + _array_kv_bytes(s.ATTR_SUMMARY_DEVICE_MS,
                                  [e[1] if measured else s.SUMMARY_NOT_MEASURED for _, e in entries])
                + _array_kv_bytes(s.ATTR_SUMMARY_HOST_MS, [e[2] for _, e in entries])
                + _array_kv_bytes(s.ATTR_SUMMARY_COUNTS, [e[3] for _, e in entries]))
        yield True, b"\x12" + varint(len(body)) + body


def sdk_requests(cfg: LoadConfig, steps: range, ranks: list[int] | None = None) -> Iterator[bytes]:
    """Encoded ``ExportTraceServiceRequest``s: per rank up to ``spans_per_request`` spans of one resource,
    round-robin over ranks (``ranks``: a subset of the layout's ranks, e.g. one shard's cohorts)."""
    infos = ranks_of(cfg.layout)
    if ranks is not None:
        keep = set(ranks)
        infos = [i for i in infos if i.rank in keep]
    sim = SimConfig(layout=cfg.layout, job=cfg.job)
    rng = random.Random(cfg.seed)
    gens = {i.rank: _rank_spans(cfg, i.rank, steps, random.Random(rng.getrandbits(32))) for i in infos}
    # ResourceSpans{resource = 1, scope_spans = 2: ScopeSpans{scope = 1, spans = 2}}
    heads = {i.rank: length_delimited(1, resource_for(i, sim).SerializeToString()) for i in infos}
    scope = length_delimited(1, length_delimited(1, s.SCOPE_NAME.encode()))
    step_scope = length_delimited(1, length_delimited(1, s.SCOPE_STEP_NAME.encode()))
    live = list(gens)
    while live:
        still = []
        for r in live:
            stage_spans: list[bytes] = []
            step_spans: list[bytes] = []
            n = 0
            for is_step, sp in gens[r]:
                (step_spans if is_step else stage_spans).append(sp)
                n += 1
                if n == cfg.spans_per_request:
                    break
            if not n:
                continue
            # the SDK's encoder groups a batch by scope: one ScopeSpans per scope present
            body = heads[r]
            if stage_spans:
                body += length_delimited(2, scope + b"".join(stage_spans))
            if step_spans:
                body += length_delimited(2, step_scope + b"".join(step_spans))
            yield length_delimited(1, body)  # ExportTraceServiceRequest.resource_spans
            if n == cfg.spans_per_request:
                still.append(r)
        live = still
