"""Verdict -> OTel log record (event), verdict span, JSON-safe dict (evidence line) and console line; a batch of
verdicts as the events the straggler connector puts into ``logs`` pipelines (``VerdictEvents``)."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Sequence

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs, SeverityNumber
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

import otel_straggler_schema as s
from collector_processor.otlp_values import key_value
from collector_processor.processor.straggler.decode import COLLECTOR_SERVICE_NAME
from collector_processor.processor.straggler.model import Verdict

_LOG_LEVEL = {s.VERDICT_STRAGGLER: logging.WARNING, s.VERDICT_RECOVERED: logging.INFO,
              s.VERDICT_UNCERTAIN: logging.DEBUG}
_SEVERITY = {
    s.VERDICT_STRAGGLER: (SeverityNumber.SEVERITY_NUMBER_WARN, "WARN"),
    s.VERDICT_RECOVERED: (SeverityNumber.SEVERITY_NUMBER_INFO, "INFO"),
    s.VERDICT_UNCERTAIN: (SeverityNumber.SEVERITY_NUMBER_DEBUG, "DEBUG"),
}


_kv = key_value


def severity(v: Verdict) -> tuple[int, str]:
    """The log record's severity: WARN straggler, INFO recovered and a collective signal (a job-level fact, never a
    page), DEBUG uncertain."""
    if v.ring:
        return _SEVERITY[s.VERDICT_RECOVERED]
    return _SEVERITY.get(v.verdict, (SeverityNumber.SEVERITY_NUMBER_DEBUG, "DEBUG"))


def event_attributes(v: Verdict) -> list[tuple[str, object]]:
    """Event attributes per docs/schema.md "Events"; optional numbers are omitted when unknown."""
    attrs: list[tuple[str, object]] = [
        (s.EVENT_NAME_ATTR, s.EVENT_VERDICT),
        (s.EV_JOB, v.job),
        (s.EV_COHORT, v.cohort),
        (s.EV_RANK, int(v.rank)),
        (s.EV_HOST, v.host),
        (s.EV_GPU, v.gpu),
        (s.EV_STAGE, v.stage),
        (s.EV_STAGE_GROUP, v.group),
        (s.EV_VERDICT, v.verdict),
        (s.EV_REASON, v.reason),
    ]
    if v.deviation is not None and math.isfinite(v.deviation):
        attrs.append((s.EV_DEVIATION, float(v.deviation)))
    if v.value_ms is not None:
        attrs.append((s.EV_VALUE_MS, float(v.value_ms)))
    if v.reference_rank is not None:
        attrs.append((s.EV_REFERENCE_RANK, int(v.reference_rank)))
    if v.reference_ms is not None:
        attrs.append((s.EV_REFERENCE_MS, float(v.reference_ms)))
    attrs += [
        (s.EV_MEASUREMENT, v.measurement),
        (s.EV_WINDOW_START, int(v.window_start)),
        (s.EV_WINDOW_END, int(v.window_end)),
    ]
    if v.step is not None:
        attrs.append((s.EV_STEP, int(v.step)))
    attrs += [
        (s.EV_ATTRIBUTION, v.attribution),
        (s.EV_STEP_TIME_LOST_MS, float(v.step_time_lost_ms)),
        (s.EV_GPU_SECONDS_PER_HOUR, float(v.gpu_seconds_per_hour)),
        (s.EV_COHORT_SIZE, int(v.cohort_size)),
        (s.EV_COLLECTIVE_EVIDENCE, v.collective_evidence),
        (s.EV_TRACE_ID, v.trace_id.hex()),
    ]
    step, trace = convicted_step(v)
    if step is not None:
        attrs.append((s.EV_FIRST_STEP, int(step)))
    if trace:
        attrs.append((s.EV_FIRST_TRACE_ID, trace.hex()))
    if v.node:
        attrs.append((s.EV_NODE, v.node))
    if v.node_ranks:
        attrs += [(s.EV_NODE_RANKS, [int(r) for r in v.node_ranks]), (s.EV_NODE_GPUS, list(v.node_gpus))]
    if v.mp_group:
        attrs.append((s.EV_GROUP, v.mp_group))
    if v.group_ranks:
        attrs.append((s.EV_GROUP_RANKS, [int(r) for r in v.group_ranks]))
    if v.victims:
        attrs.append((s.EV_VICTIMS, [int(r) for r in v.victims]))
    if v.victim_of:
        attrs.append((s.EV_VICTIM_OF, v.victim_of))
    if v.hint:
        attrs.append((s.EV_HINT, v.hint))
    if v.period_steps is not None:
        attrs += [(s.EV_PERIOD_STEPS, float(v.period_steps)), (s.EV_EPISODES, int(v.episodes))]
    if v.ring:
        attrs.append((s.EV_COLLECTIVE_RING, v.ring))
    if v.link_rank is not None:
        attrs.append((s.EV_COLLECTIVE_RANK, int(v.link_rank)))
    return attrs


def convicted_step(v: Verdict) -> tuple[int | None, bytes]:
    """(step, trace id) where the verdict's alert was first convicted: the verdict's own step for a new
    straggler verdict or one without an alert, the alert's for a refresh, hold or recovery."""
    if v.first_step is not None and len(v.first_trace_id) == 16:
        return v.first_step, v.first_trace_id
    return v.step, v.trace_id if len(v.trace_id) == 16 else b""


def summary(v: Verdict) -> str:
    """One-line human summary (the log record's body)."""
    where = f"rank {v.rank} ({v.host}, {v.gpu}) stage {v.stage}"
    if v.group_ranks:
        where = f"group {v.mp_group} (ranks {','.join(map(str, v.group_ranks))}) stage {v.stage}"
    span = f"steps {v.window_start}-{v.window_end}"
    if v.ring and v.verdict == s.VERDICT_UNCERTAIN:
        who = (f"rank {v.link_rank} ({v.host}, {v.gpu}) link errors" + (f": {v.hint}" if v.hint else "")
               if v.link_rank is not None else "no member named")
        return (f"collective slow: {v.ring} ring of cohort {v.cohort} (ranks {','.join(map(str, v.group_ranks))}) "
                f"stage {v.stage} {v.value_ms or 0.0:.1f} ms vs baseline {v.reference_ms or 0.0:.1f} ms "
                f"({v.measurement}, {span}), {v.step_time_lost_ms:.1f} ms/step lost, "
                f"{v.gpu_seconds_per_hour:.0f} GPU-s/h; {who}")
    if v.verdict == s.VERDICT_STRAGGLER and (v.victims or v.victim_of):
        dev = f"{v.deviation * 100:+.1f}%" if v.deviation is not None else "?"
        role = (f"culprit of group {v.mp_group}, victims ranks {','.join(map(str, v.victims))}" if v.victims
                else f"victim in group {v.mp_group}, waits for {v.victim_of}")
        return (f"straggler: {where} {dev} ({v.measurement}, {span}), {role}, {v.attribution}, "
                f"{v.step_time_lost_ms:.1f} ms/step lost, {v.gpu_seconds_per_hour:.0f} GPU-s/h")
    if v.verdict == s.VERDICT_STRAGGLER and v.period_steps is not None:
        return (f"straggler: {where} intermittent: {v.episodes} spike episodes every {v.period_steps:g} steps "
                f"({v.measurement}, {span}), {v.attribution}, {v.step_time_lost_ms:.1f} ms/step lost "
                f"({(v.deviation or 0.0) * 100:+.1f}% of the peers' median), {v.gpu_seconds_per_hour:.0f} GPU-s/h")
    if v.verdict == s.VERDICT_STRAGGLER:
        dev = f"{v.deviation * 100:+.1f}%" if v.deviation is not None else "?"
        return (f"straggler: {where} {dev} vs rank {v.reference_rank} ({v.measurement}, {span}), "
                f"{v.attribution}, {v.step_time_lost_ms:.1f} ms/step lost, "
                f"{v.gpu_seconds_per_hour:.0f} GPU-s/h" + (f"; {v.hint}" if v.hint else ""))
    if v.verdict == s.VERDICT_RECOVERED:
        return f"recovered: {where} back within tolerance ({v.measurement}, {span})"
    return f"uncertain: {where} {v.reason} ({span})"


def verdicts_to_logs(verdicts: Iterable[Verdict], service_name: str = COLLECTOR_SERVICE_NAME
                     ) -> ExportLogsServiceRequest:
    records = []
    for v in verdicts:
        number, text = severity(v)
        rec = LogRecord(
            time_unix_nano=v.emitted_unix_ns,
            observed_time_unix_nano=v.emitted_unix_ns,
            severity_number=number,
            severity_text=text,
            body=AnyValue(string_value=summary(v)),
            attributes=[_kv(k, val) for k, val in event_attributes(v)],
            event_name=s.EVENT_VERDICT,
        )
        step, trace = convicted_step(v)
        if trace:
            rec.trace_id = trace
            if step is not None:  # the verdict span's id (verdict_span): the record links to that span
                rec.span_id = verdict_span_id(v)
        records.append(rec)
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(
        resource=Resource(attributes=[_kv(s.RES_SERVICE_NAME, service_name)]),
        scope_logs=[ScopeLogs(scope=InstrumentationScope(name=s.SCOPE_NAME), log_records=records)],
    )])


def verdict_to_dict(v: Verdict) -> dict[str, object]:
    """JSON-safe dict (non-finite numbers become None, bytes become hex) for the JSONL evidence."""
    out: dict[str, object] = {}
    for name in Verdict.__slots__:  # type: ignore[attr-defined]
        val = getattr(v, name)
        if isinstance(val, bytes):
            val = val.hex()
        elif isinstance(val, float) and not math.isfinite(val):
            val = None
        out[name] = val
    out["summary"] = summary(v)
    return out


def verdict_line(v: Verdict) -> str:
    """One console line (the ``debug`` exporter's)."""
    dev = "n/a" if v.deviation is None else f"{v.deviation:+.1%}"
    return (f"verdict={v.verdict} reason={v.reason} job={v.job} rank={v.rank} host={v.host} stage={v.stage} "
            f"deviation={dev} window={v.window_start}..{v.window_end} attribution={v.attribution} "
            f"lost_ms_per_step={v.step_time_lost_ms:.1f}")


class VerdictEvents:
    """Verdicts as a ``component.EventBatch``: evidence records, console lines, or OTLP logs (built once)."""

    def __init__(self, verdicts: Sequence[Verdict], service_name: str = COLLECTOR_SERVICE_NAME) -> None:
        self.verdicts = list(verdicts)
        self._service_name = service_name
        self._logs: ExportLogsServiceRequest | None = None

    def __len__(self) -> int:
        return len(self.verdicts)

    def records(self) -> list[dict[str, object]]:
        return [verdict_to_dict(v) for v in self.verdicts]

    def console_lines(self) -> list[tuple[int, str]]:
        """A straggler verdict at WARNING, a recovery and a collective signal at INFO, an uncertain window at DEBUG
        (the log records' severities)."""
        return [(logging.INFO if v.ring else _LOG_LEVEL.get(v.verdict, logging.DEBUG), verdict_line(v))
                for v in self.verdicts]

    def to_logs(self) -> ExportLogsServiceRequest:
        if self._logs is None:
            self._logs = verdicts_to_logs(self.verdicts, self._service_name)
        return self._logs


def verdict_span_id(v: Verdict) -> bytes:
    key = f"{v.job}/{v.cohort}/{v.rank}/{v.stage}/{v.verdict}/{v.reason}/{v.window_start}/{v.emitted_unix_ns}"
    return hashlib.sha256(key.encode()).digest()[:8]


def _reference_link(v: Verdict, step: int) -> list[Span.Link]:
    """A link to the reference rank's ``rank-step`` span of the step (in its block's step trace, which is another
    trace when the reference's rank is in another block of 64)."""
    if v.reference_rank is None or v.reference_rank < 0:
        return []
    run = s.cohort_run(v.cohort)
    ref = v.reference_rank
    return [Span.Link(trace_id=s.trace_id_for_step(v.job, step, run, s.trace_block(ref)).to_bytes(16, "big"),
                      span_id=s.rank_step_span_id(v.job, step, ref, run).to_bytes(8, "big"))]


def verdict_span(v: Verdict) -> Span | None:
    """The verdict as a span in the step trace where its alert was first convicted (the one of the rank's block of
    64, ``s.trace_block``), child of that trace's ``train-step`` root, linked to the reference rank's ``rank-step``
    span (None without a step)."""
    step, trace = convicted_step(v)
    if step is None or not trace:
        return None
    return Span(
        trace_id=trace,
        span_id=verdict_span_id(v),
        parent_span_id=s.step_root_span_id(int.from_bytes(trace, "big")).to_bytes(8, "big"),
        links=_reference_link(v, step),
        name=s.SPAN_VERDICT,
        kind=Span.SpanKind.SPAN_KIND_INTERNAL,
        start_time_unix_nano=v.emitted_unix_ns,
        end_time_unix_nano=v.emitted_unix_ns,
        attributes=[_kv(k, val) for k, val in event_attributes(v)],
    )


def verdict_resource_spans(verdicts: Iterable[Verdict], service_name: str = COLLECTOR_SERVICE_NAME
                           ) -> ResourceSpans | None:
    spans = [sp for sp in (verdict_span(v) for v in verdicts) if sp is not None]
    if not spans:
        return None
    return ResourceSpans(
        resource=Resource(attributes=[_kv(s.RES_SERVICE_NAME, service_name)]),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name=s.SCOPE_NAME), spans=spans)],
    )
