"""Local exporters: JSONL evidence (flush interval, rotation, complete lines), Prometheus ``/metrics`` with the
emitter self-metrics re-exported from real OTel SDK metric exports, and the debug console."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from service_support import BASE_RECEIVER, DoubleProcessor, make_spans, make_verdict, scrape, wait_for

import otel_straggler_schema as s
from collector_processor.exporter.evidence import Config as EvidenceConfig
from collector_processor.exporter.evidence import EvidenceExporter
from collector_processor.processor.straggler.events import VerdictEvents, verdict_to_dict
from collector_processor.telemetry import Telemetry


def test_evidence_lines_flushed_within_interval_while_running(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ev" / "verdicts.jsonl"
    text = BASE_RECEIVER + f"""
processors:
  double: {{verdicts: true}}
exporters:
  file/evidence: {{path: "{path}", flush_interval: 200ms}}
  debug: {{}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [debug]}}
    logs/verdicts: {{receivers: [double], exporters: [file/evidence]}}
"""
    run = start_service(text)
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    for _ in range(3):
        assert exp.export(make_spans(2)) == SpanExportResult.SUCCESS
    exp.shutdown()
    t0 = time.monotonic()
    # no shutdown: the background flush alone must put the lines on disk (what a SIGKILL would leave)
    assert wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 3, timeout=30)
    print(f"on disk {time.monotonic() - t0:.2f} s after the last export (flush_interval 200 ms)")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert lines[0] == json.loads(json.dumps(verdict_to_dict(make_verdict(step=1)) | {
        "emitted_unix_ns": lines[0]["emitted_unix_ns"]}))
    assert run.sample("otel_straggler_collector_evidence_lines_total") == 3


def test_evidence_rotation_keeps_max_files_of_complete_lines(tmp_path: Path) -> None:
    t = Telemetry()
    path = tmp_path / "v.jsonl"
    ex = EvidenceExporter("file/e", EvidenceConfig(path=str(path), flush_interval=60, max_bytes=2048, max_files=3), t)
    ex.start()
    for i in range(40):
        ex.export_events(VerdictEvents([make_verdict(step=i)]))
        if i % 5 == 4:
            ex.flush()
    ex.shutdown()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["v.jsonl", "v.jsonl.1", "v.jsonl.2"]
    steps = []
    for f in (path.with_name("v.jsonl.2"), path.with_name("v.jsonl.1"), path):
        assert f.stat().st_size <= 2048
        steps += [json.loads(line)["step"] for line in f.read_text().splitlines()]
    assert steps == list(range(40 - len(steps), 40))  # newest kept, in order, none torn
    assert t.registry.get_sample_value("otel_straggler_collector_evidence_lines_total") == 40


# what Prometheus 2.x sends when it scrapes
OPENMETRICS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                      "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_prometheus_serves_self_metrics_and_reexports_emitter_metrics(start_service) -> None:  # type: ignore[no-untyped-def]
    text = BASE_RECEIVER + """
processors:
  double: {}
exporters:
  prometheus: {endpoint: 127.0.0.1:0, max_series: 3, auth: {bearer_token: ${env:MT}}}
  debug: {}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug]}
    metrics: {receivers: [otlp], exporters: [prometheus]}
"""
    run = start_service(text, env={"MT": "scrape-me"})
    port = run.svc.exporters["prometheus"].port
    url = f"http://127.0.0.1:{port}/metrics"
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=run.grpc, insecure=True, timeout=5),
                                           export_interval_millis=60_000)
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False,
                       resource=Resource.create({s.RES_JOB_ID: "job-9", s.RES_RANK: 5}))
    meter = mp.get_meter(s.SCOPE_NAME)
    dropped = meter.create_counter(s.SM_DROPPED)
    dropped.add(4, {s.SM_REASON_ATTR: "ring_full"})
    dropped.add(1, {s.SM_REASON_ATTR: "late"})
    meter.create_counter(s.SM_INTERVALS).add(100)
    meter.create_gauge(s.SM_READOUT_LAG, unit=s.UNIT_SECONDS).set(2.5)
    meter.create_counter("unrelated.metric").add(1)
    mp.force_flush(5000)
    dropped.add(2, {s.SM_REASON_ATTR: "ring_full"})
    mp.force_flush(5000)
    mp.shutdown()
    with pytest.raises(urllib.error.HTTPError) as ei:
        scrape(url)
    assert ei.value.code == 401
    m = scrape(url, {"Authorization": "Bearer scrape-me"})
    assert m["otel_straggler_emitter_dropped_total{rank=5,reason=ring_full,training_job=job-9}"] == 6  # cumulative
    assert m["otel_straggler_emitter_dropped_total{rank=5,reason=late,training_job=job-9}"] == 1
    assert m["otel_straggler_emitter_intervals_total{rank=5,training_job=job-9}"] == 100
    assert not any(k.startswith("otel_straggler_emitter_readout") for k in m)  # 4th series: over the cap of 3
    assert not any("unrelated" in k for k in m)
    assert m["otel_straggler_collector_evictions_total{structure=metric_series}"] >= 1
    assert m["otel_straggler_collector_requests_total{outcome=ok,receiver=otlp/grpc}"] == 3  # 2 flushes + shutdown
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
        assert resp.status == 200 and resp.read() == b"ok\n"
    # OpenMetrics when asked (as Prometheus asks): both registries in one exposition with one "# EOF" at the end
    req = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-me", "Accept": OPENMETRICS_ACCEPT})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        om = resp.read().decode()
    assert om.endswith("# EOF\n") and om.count("# EOF") == 1
    assert 'otel_straggler_emitter_dropped_total{rank="5",reason="ring_full",training_job="job-9"} 6.0' in om
    assert "otel_straggler_collector_requests_total{" in om


def test_emitter_metrics_take_prometheus_names_by_unit_and_kind(start_service) -> None:  # type: ignore[no-untyped-def]
    """Real SDK exports of the emitter's instruments with their units: a gauge in ``s`` gets ``_seconds``, a gauge
    of unit ``1`` no suffix, a counter ``_total``; a name already ending in its unit is not suffixed twice; the
    instrument's description is the HELP text."""
    text = BASE_RECEIVER + """
exporters:
  prometheus: {endpoint: 127.0.0.1:0}
service:
  pipelines:
    metrics: {receivers: [otlp], exporters: [prometheus]}
"""
    run = start_service(text)
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=run.grpc, insecure=True, timeout=5),
                                           export_interval_millis=60_000)
    mp = MeterProvider(metric_readers=[reader], shutdown_on_exit=False,
                       resource=Resource.create({s.RES_JOB_ID: "j", s.RES_RANK: 0}))
    meter = mp.get_meter("x")
    meter.create_gauge(s.SM_POOL_HIGH_WATER, unit=s.UNIT_COUNT).set(17)
    meter.create_gauge(s.SM_READOUT_LAG, unit=s.UNIT_SECONDS, description="Stop to readout").set(0.25)
    meter.create_counter(s.SM_INTERVALS, unit=s.UNIT_COUNT).add(3)
    meter.create_counter("otel_straggler.emitter.spill.bytes", unit="By").add(4096)
    meter.create_up_down_counter("otel_straggler.emitter.wait_seconds", unit="s").add(2)  # not monotonic: gauge
    mp.shutdown()
    # a second run under the job id: its series carry its run id; its ranks' last metrics say they ended
    mp2 = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=run.grpc, insecure=True, timeout=5), export_interval_millis=60_000)],
        shutdown_on_exit=False, resource=Resource.create({s.RES_JOB_ID: "j", s.RES_RANK: 0, s.RES_RUN_ID: "r2"}))
    mp2.get_meter("x").create_gauge(s.SM_ENDED, unit=s.UNIT_COUNT).set(1)
    mp2.shutdown()
    url = f"http://127.0.0.1:{run.svc.exporters['prometheus'].port}/metrics"
    m = scrape(url)
    assert m["otel_straggler_emitter_ended{rank=0,run=r2,training_job=j}"] == 1
    assert m["otel_straggler_emitter_pool_high_water{rank=0,training_job=j}"] == 17
    assert m["otel_straggler_emitter_readout_lag_seconds{rank=0,training_job=j}"] == 0.25
    assert m["otel_straggler_emitter_intervals_total{rank=0,training_job=j}"] == 3
    assert m["otel_straggler_emitter_spill_bytes_total{rank=0,training_job=j}"] == 4096
    assert m["otel_straggler_emitter_wait_seconds{rank=0,training_job=j}"] == 2
    assert not [k for k in m if k.startswith("otel_straggler_emitter_readout_lag{")]
    with urllib.request.urlopen(url, timeout=5) as resp:
        page = resp.read().decode()
    assert "# HELP otel_straggler_emitter_readout_lag_seconds Stop to readout\n" in page
    assert "# TYPE otel_straggler_emitter_readout_lag_seconds gauge\n" in page
    assert "# HELP otel_straggler_emitter_pool_high_water Emitter self-metric re-exported from OTLP\n" in page


def test_every_counter_exists_at_zero_before_any_traffic(start_service, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The shipped configs/collector.yaml, scraped before any request: each collector counter is on /metrics at 0
    with every reason and outcome of the schema and the id of every configured component it counts for, so a
    ``rate()`` sees the first event; no series is made up for a component that is not configured."""
    from collector_processor.processor.straggler.processor import EVICTED_STRUCTURES

    text = (Path(__file__).resolve().parents[2] / "configs" / "collector.yaml").read_text(encoding="utf-8")
    run = start_service(text, env={
        "OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT": "127.0.0.1:0", "OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT": "127.0.0.1:0",
        "OTEL_STRAGGLER_METRICS_ENDPOINT": "127.0.0.1:0", "OTEL_STRAGGLER_EVIDENCE_PATH": str(tmp_path / "v.jsonl")})
    m = scrape(f"http://127.0.0.1:{run.svc.exporters['prometheus'].port}/metrics")
    receivers = ("otlp/grpc", "otlp/http")
    otlp, signals = ("otlp_grpc/traces", "otlp_http/events"), ("traces", "logs")
    expected = {
        s.M_SPANS_DROPPED: [{"reason": r} for r in s.COLLECTOR_DROPPED_REASONS],
        s.M_SPANS_REJECTED: [{"reason": r} for r in s.COLLECTOR_REJECTED_REASONS],
        s.M_SPANS_RECEIVED: [{"receiver": r} for r in receivers],
        s.M_REQUESTS: [{"receiver": r, "outcome": o} for r in receivers for o in s.COLLECTOR_REQUEST_OUTCOMES],
        s.M_UNAUTHENTICATED: [{"endpoint": e} for e in (*receivers, "prometheus")],
        s.M_TENANT_REFUSED: [{"receiver": r} for r in receivers],
        s.M_CONNECTIONS_CLOSED: [{"receiver": r, "reason": x} for r in receivers
                                 for x in s.COLLECTOR_CONNECTION_CLOSE_REASONS],
        s.M_EXPORT_FAILURES: [{"exporter": e} for e in ("otlp_grpc/traces", "file/evidence", "debug",
                                                         "otlp_http/events", "prometheus")],
        s.M_COMPONENT_ERRORS: [{"component": c} for c in ("memory_limiter", "straggler", "file/evidence")],
        s.M_EVICTIONS: [{"structure": x} for x in (*EVICTED_STRUCTURES, "metric_series", "evidence_buffer",
                                                   "queue:traces", "queue:logs/verdicts", "queue:metrics")],
        s.M_INLINE_DEFERRED: [{"pipeline": p} for p in ("traces", "logs/verdicts", "metrics")],
        s.M_SPANS_ACCEPTED: [{}], s.M_WINDOWS_CLOSED: [{}], s.M_EVIDENCE_LINES: [{}],
        s.M_DUPLICATE_IDENTITY: [{"receiver": r} for r in receivers],
        s.M_TENANT_EVICTIONS: [{"tenant": "all-jobs", "structure": x} for x in (
            "cohorts", "windows", "metric_series", "memory", "queue:traces", "queue:logs/verdicts", "queue:metrics")],
        s.M_EXPORTER_ENQUEUED: [{"exporter": e, "signal": g} for e in otlp for g in signals],
        s.M_EXPORTER_SENT: [{"exporter": e, "signal": g} for e in otlp for g in signals],
        s.M_EXPORTER_QUEUED: [{"exporter": e, "signal": g} for e in otlp for g in signals],
        s.M_EXPORTER_FAILED: [{"exporter": e, "signal": g, "reason": x} for e in otlp for g in signals
                              for x in s.EXPORTER_FAILED_REASONS],
    }
    for name, label_sets in expected.items():
        for labels in label_sets:
            key = name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            assert m.get(key) == 0, key
        present = [k for k in m if k == name or k.startswith(name + "{")]
        assert len(present) == len(label_sets), (name, sorted(present))  # nothing beyond the configuration
    counters = {v for k, v in vars(s).items() if k.startswith("M_") and isinstance(v, str)
                and v.startswith("otel_straggler_collector_") and v.endswith("_total")}
    assert counters <= set(expected)


@pytest.mark.parametrize(("name", "unit", "counter", "expected"), [
    ("otel_straggler.emitter.readout.lag", "s", False, "otel_straggler_emitter_readout_lag_seconds"),
    ("otel_straggler.emitter.dropped", "1", True, "otel_straggler_emitter_dropped_total"),
    ("otel_straggler.emitter.pool.high_water", "1", False, "otel_straggler_emitter_pool_high_water"),
    ("system.filesystem.usage", "By", False, "system_filesystem_usage_bytes"),
    ("net.io", "By/s", False, "net_io_bytes_per_second"),
    ("system.network.dropped", "{packets}", True, "system_network_dropped_total"),
    ("queue.wait_seconds", "s", False, "queue_wait_seconds"),
    ("requests_total", "1", True, "requests_total"),
    ("x.latency", "ms", False, "x_latency_milliseconds"),
    ("(lambda).function.executions(#)", "", True, "lambda_function_executions_total"),
    ("rows", "widgets", False, "rows_widgets"),
])
def test_otel_to_prometheus_names(name: str, unit: str, counter: bool, expected: str) -> None:
    from collector_processor.exporter.prometheus_names import prometheus_name

    assert prometheus_name(name, unit, counter) == expected


def test_debug_prints_one_line_per_verdict(start_service, caplog) -> None:  # type: ignore[no-untyped-def]
    text = BASE_RECEIVER + """
processors:
  double: {verdicts: true}
exporters:
  debug: {verbosity: basic}
service:
  pipelines:
    traces: {receivers: [otlp], processors: [double], exporters: [debug]}
    logs/verdicts: {receivers: [double], exporters: [debug]}
"""
    caplog.set_level("INFO", logger="otel-straggler-collector.events")  # a straggler verdict: WARNING
    run = start_service(text)
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    exp.export(make_spans(2))
    exp.shutdown()
    assert wait_for(lambda: len(DoubleProcessor.instances[0].requests) == 1)
    run.svc.shutdown(2)  # drains the verdict queue; the double also emits one verdict (step 9999) at shutdown
    lines = [r.getMessage() for r in caplog.records
             if r.name == "otel-straggler-collector.events" and r.levelname == "WARNING"]
    assert len(lines) == 2
    assert all("verdict=straggler" in x and "rank=3" in x and "deviation=+25.0%" in x for x in lines)
    assert "window=9990..9999" in lines[1]


def test_telemetry_address_serves_self_metrics_without_a_prometheus_exporter(start_service) -> None:  # type: ignore[no-untyped-def]
    from service_support import free_port

    port = free_port()
    text = BASE_RECEIVER + f"""
processors:
  double: {{}}
exporters:
  debug: {{}}
service:
  pipelines:
    traces: {{receivers: [otlp], processors: [double], exporters: [debug]}}
  telemetry: {{metrics: {{address: "127.0.0.1:{port}"}}}}
"""
    run = start_service(text)
    assert any(f"127.0.0.1:{port}/metrics" in e for e in run.svc.endpoints())
    exp = GrpcSpanExporter(endpoint=run.grpc, insecure=True, timeout=5)
    assert exp.export(make_spans(4)) == SpanExportResult.SUCCESS
    exp.shutdown()
    m = scrape(f"http://127.0.0.1:{port}/metrics")
    assert m["otel_straggler_collector_spans_received_total{receiver=otlp/grpc}"] == 4
    assert m["otel_straggler_collector_processing_seconds_count"] >= 1
