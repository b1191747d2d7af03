"""OTLP span -> ``StageSample``: one pass over each span's attribute list, resource attributes once per resource.

Two sources, chosen per resource. A resource with ``straggler.step_summary = true`` (this project's emitter,
schema 2): only its step scope (``otel-straggler.step``) is read, and each ``rank-step`` span's summary
arrays give one sample per timer (plus the rank-step sample itself); its stage spans are not decoded at all
(they are for trace backends), which is what keeps the per-span cost near the parse floor. Any other
resource: every stage span is decoded.

A span is a stage span iff it carries ``straggler.stage``. Outcomes per stage span: a sample, or a rejection
reason (``malformed``: no rank/cohort on the resource or no duration at all; ``non_finite``: every duration
present is NaN, infinite or negative). A non-finite duration next to a finite one is dropped from the sample
(and counted by the caller through ``DecodeResult.non_finite_values``); it never becomes a reference.
A stage marked as holding a collective wait (``straggler.stage.collective`` on a stage span, its name in
``straggler.summary.collective`` on a rank-step) is passed on as such (``collective``); the processor
records the mark on the cohort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

import otel_straggler_schema as s
from collector_processor.processor.straggler import arrays, hints
from collector_processor.processor.straggler.model import StageSample, StepSummary
from collector_processor.resource_identity import ResourceIdentity, identity, read_identity

REJECT_MALFORMED = "malformed"
REJECT_NON_FINITE = "non_finite"
REJECT_DUPLICATE = "duplicate"
REJECT_LATE = "late"
REJECT_OVER_CAP = "over_cap"  # a stage span beyond max_samples_per_step of its (rank, step, stage)
# a step far beyond the cohort's current range (step_quarantine_windows): never opens or closes a window
REJECT_QUARANTINED = "quarantined"
MAX_DURATION_MS = 86_400_000.0  # one day: a longer stage or step is a broken clock, counted as non_finite

COLLECTOR_SERVICE_NAME = s.SERVICE_COLLECTOR

_isfinite = math.isfinite


@dataclass(slots=True)
class DecodeResult:
    samples: list[StageSample] = field(default_factory=list)
    summaries: list[StepSummary] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    non_finite_values: int = 0
    stage_spans: int = 0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


def resource_identity(rs: ResourceSpans) -> ResourceIdentity:
    """The identity of ``rs``'s resource (``resource_identity.read_identity``)."""
    return read_identity(rs.resource)


def decode_resource_spans(rs: ResourceSpans, out: DecodeResult, skip_service: str = COLLECTOR_SERVICE_NAME) -> None:
    """Append the stage samples of one ResourceSpans to ``out``, counting rejections. Spans of the
    collector's own resource (verdict spans carry ``straggler.stage``) are skipped."""
    ident = identity(rs.resource)
    if ident.service == skip_service:
        return
    if ident.duplicate:  # refused by the receivers; reached here only from a pipeline fed in process
        n = sum(len(ss.spans) for ss in rs.scope_spans)
        out.rejected[REJECT_MALFORMED] = out.rejected.get(REJECT_MALFORMED, 0) + n
        return
    if ident.summary:
        step_scope = s.SCOPE_STEP_NAME
        for ss in rs.scope_spans:
            if ss.scope.name == step_scope:
                for span in ss.spans:
                    _decode_summary(span, ident, out)
        return
    k_stage = s.ATTR_STAGE
    k_group = s.ATTR_STAGE_GROUP
    k_iter = s.ATTR_ITERATION
    k_dev = s.ATTR_DEVICE_MS
    k_host = s.ATTR_HOST_MS
    k_count = s.ATTR_COUNT
    k_tokens = s.ATTR_WORKLOAD_TOKENS
    k_collective = s.ATTR_STAGE_COLLECTIVE
    for ss in rs.scope_spans:
        for span in ss.spans:
            stage = None
            group = "other"
            step = None
            dev = None
            host = None
            count = 1
            tokens = None
            collective = False
            for kv in span.attributes:
                k = kv.key
                if k == k_stage:
                    stage = kv.value.string_value
                elif k == k_dev:  # 0.0 or not a double: ask which (rare)
                    dev = kv.value.double_value or arrays.number(kv.value)
                elif k == k_host:
                    host = kv.value.double_value or arrays.number(kv.value)
                elif k == k_iter:
                    step = kv.value.int_value
                elif k == k_group:
                    group = kv.value.string_value
                elif k == k_count:
                    count = kv.value.int_value
                elif k == k_tokens:
                    t = kv.value.int_value
                    tokens = t if t > 0 else None
                elif k == k_collective:
                    collective = kv.value.bool_value
            if stage is None:
                continue
            out.stage_spans += 1
            if not ident.usable or not stage or (dev is None and host is None):
                out.reject(REJECT_MALFORMED)
                continue
            dev, host = _clean(dev, host, out)
            out.samples.append(StageSample(
                ident.job, ident.cohort, ident.rank, ident.host, ident.gpu, ident.world_size,
                stage, group, step, dev, host, count if count > 0 else 1, tokens,
                span.start_time_unix_nano, span.end_time_unix_nano, span.trace_id, span.span_id,
                ident.dp_size, collective, ident.dp_rank,
            ))


# the rank-step attributes a summary is read from -> what each is (one dict lookup per attribute)
_DEVS, _HOSTS, _STAGES, _GROUPS, _COUNTS, _STEP, _HOST_TOTAL, _TOKENS, _COLLECTIVE, _HINT = range(10)
_SUMMARY_KEYS: dict[str, int] = {k: _HINT for k in hints.KEYS} | {
    s.ATTR_SUMMARY_DEVICE_MS: _DEVS, s.ATTR_SUMMARY_HOST_MS: _HOSTS, s.ATTR_SUMMARY_STAGES: _STAGES,
    s.ATTR_SUMMARY_GROUPS: _GROUPS, s.ATTR_SUMMARY_COUNTS: _COUNTS, s.ATTR_ITERATION: _STEP,
    s.ATTR_HOST_MS: _HOST_TOTAL, s.ATTR_WORKLOAD_TOKENS: _TOKENS, s.ATTR_SUMMARY_COLLECTIVE: _COLLECTIVE,
}


# what a rank-step's attributes say: step, its host time, tokens, then the summary arrays (stages, groups, device
# and host times, counts), the stages marked collective and the NVML sample
_Summary = tuple[int | None, float | None, int | None, Sequence[str] | None, Sequence[str] | None,
                 Sequence[float] | None, Sequence[float] | None, Sequence[int] | None, Sequence[str],
                 dict[str, object] | None]


def _summary_attributes(span: object) -> _Summary:
    """One pass over a ``rank-step`` span's attributes: what its summary is read from (``_SUMMARY_KEYS``)."""
    step = None
    host_total = None
    tokens = None
    stages = groups = devs = hosts = counts = None
    collective: Sequence[str] = ()
    gpu: dict[str, object] | None = None
    which = _SUMMARY_KEYS.get
    for kv in span.attributes:  # type: ignore[attr-defined]
        k = kv.key
        slot = which(k)
        if slot is None:
            continue
        if slot == _DEVS:
            devs = arrays.attribute_doubles(kv, k)
        elif slot == _HOSTS:
            hosts = arrays.attribute_doubles(kv, k)
        elif slot == _STAGES:
            stages = arrays.attribute_strings(kv)
        elif slot == _GROUPS:
            groups = arrays.attribute_strings(kv)
        elif slot == _COUNTS:
            counts = arrays.attribute_ints(kv)
        elif slot == _STEP:
            step = kv.value.int_value
        elif slot == _HOST_TOTAL:  # 0.0 or not a double: ask which (rare)
            host_total = kv.value.double_value or arrays.number(kv.value)
        elif slot == _TOKENS:
            t = kv.value.int_value
            tokens = t if t > 0 else None
        elif slot == _COLLECTIVE:
            collective = arrays.attribute_strings(kv)
        else:  # NVML cause hints (only where the emitter samples them)
            if gpu is None:
                gpu = {}
            kind = hints.KEYS[k]
            gpu[k] = (arrays.strings(kv.value.array_value) if kind == "strings"
                      else kv.value.int_value if kind == "int" else arrays.number(kv.value))
    return step, host_total, tokens, stages, groups, devs, hosts, counts, collective, gpu


def _decode_summary(span: object, ident: ResourceIdentity, out: DecodeResult) -> None:
    """One ``rank-step`` span with its step summary -> one ``StepSummary``: the rank-step's own host time
    (entry 0, when finite) and one entry per timer; bad entries counted as the stage-span path counts them."""
    step, host_total, tokens, stages, groups, devs, hosts, counts, collective, gpu = _summary_attributes(span)
    if stages is None:
        return  # the job-level train-step (or a step span without summary): nothing to judge
    n = len(stages)
    out.stage_spans += 1
    if (not ident.usable or step is None or groups is None or devs is None or hosts is None or counts is None
            or not (len(groups) == len(devs) == len(hosts) == len(counts) == n)):
        out.reject(REJECT_MALFORMED)
        return
    out.stage_spans += n
    host_ok = host_total is not None and _isfinite(host_total) and host_total >= 0.0
    if not host_ok:  # the rank-step's own sample, counted as its stage span would be
        if host_total is None:
            out.reject(REJECT_MALFORMED)
        else:
            out.non_finite_values += 1
            out.reject(REJECT_NON_FINITE)
    # the rank-step itself first (its host time, as its stage span would give it), then one entry per timer
    names: list[str] = [s.SPAN_RANK_STEP] if host_ok else []
    grps = ["step"] if host_ok else []
    dev_out: list[float | None] = [None] if host_ok else []
    host_out: list[float | None] = [host_total] if host_ok else []
    cnt = [1] if host_ok else []
    dev_entries = _device_entries(devs, n)
    if dev_entries is not None and _clean_values(hosts) and all(stages) and all(groups) and min(counts) > 0:
        # every entry valid, as a healthy emitter sends them: whole lists at once, what the loop below gives
        # entry by entry (this runs once per rank-step: per-entry calls would be most of the decode's cost)
        names += stages
        grps += groups
        dev_out += dev_entries
        host_out += hosts
        cnt += counts
    else:
        not_measured = s.SUMMARY_NOT_MEASURED
        for i, stage in enumerate(stages):
            if not stage:
                out.reject(REJECT_MALFORMED)
                continue
            dev, host_ms = _clean(None if devs[i] == not_measured else devs[i], hosts[i], out)
            names.append(stage)
            grps.append(groups[i] or "other")
            dev_out.append(dev)
            host_out.append(host_ms)
            cnt.append(counts[i] if counts[i] > 0 else 1)
    out.summaries.append(StepSummary(
        ident.job, ident.cohort, ident.rank, ident.host, ident.gpu, ident.world_size, ident.dp_size, step, tokens,
        span.start_time_unix_nano, span.end_time_unix_nano, span.trace_id, span.span_id,  # type: ignore[attr-defined]
        names, grps, dev_out, host_out, cnt, collective, ident.dp_rank, gpu))


def _device_entries(devs: Sequence[float], n: int) -> Sequence[float | None] | None:
    """The summary's device times with "not measured" as None; None when a measured one is negative or not
    finite (the per-entry path drops and counts those)."""
    not_measured = s.SUMMARY_NOT_MEASURED
    missing = devs.count(not_measured)
    if not missing:
        return devs if _clean_values(devs) else None
    if missing == n:  # a step without device timing (sampled)
        return [None] * n
    if not _clean_values([d for d in devs if d != not_measured]):
        return None
    return [None if d == not_measured else d for d in devs]


def _clean_values(values: Sequence[float]) -> bool:
    """True when a non-empty list holds only plausible durations: its minimum is not negative, its sum is
    finite (a NaN or an infinity makes the sum NaN or infinite; a NaN can hide from ``min``, never from the
    sum) and within ``MAX_DURATION_MS``. Anything else goes down the per-entry path."""
    return bool(values) and min(values) >= 0.0 and _isfinite(total := sum(values)) and total <= MAX_DURATION_MS


def _clean(dev: float | None, host: float | None, out: DecodeResult) -> tuple[float | None, float | None]:
    """Drop (and count) a NaN, infinite, negative or implausible (over ``MAX_DURATION_MS``) duration: a
    finite but absurd value would overflow the cost arithmetic downstream. A sample left with neither is rejected
    (non_finite) but still handed on, so the window knows the rank reported only unusable values:
    uncertain/non_finite_sample rather than a silent gap."""
    bad = 0
    if dev is not None and not (_isfinite(dev) and 0.0 <= dev <= MAX_DURATION_MS):
        dev = None
        bad += 1
    if host is not None and not (_isfinite(host) and 0.0 <= host <= MAX_DURATION_MS):
        host = None
        bad += 1
    if bad:
        out.non_finite_values += bad
        if dev is None and host is None:
            out.reject(REJECT_NON_FINITE)
    return dev, host


def decode_request(resource_spans: object, skip_service: str = COLLECTOR_SERVICE_NAME) -> DecodeResult:
    out = DecodeResult()
    for rs in resource_spans:  # type: ignore[attr-defined]
        decode_resource_spans(rs, out, skip_service)
    return out
