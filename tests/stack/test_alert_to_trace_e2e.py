"""From the straggler alert to the slow step's trace, end to end with the real programs.

A 4-rank training job (one Resource + TracerProvider per rank, stage spans through the OTel SDK's
``OTLPSpanExporter`` over gRPC) runs rank 3 30 % slow in ``forward-compute``. The straggler collector runs
``configs/collector-compose.yaml`` on loopback ports, its Jaeger and Tempo forwarders pointed at two in-test OTLP
trace backends. A real Prometheus scrapes it with the default scrape config (``honor_labels: false``, exemplar
storage on) and evaluates the shipped rules (``for`` shortened to 2 s); a real Alertmanager routes with the shipped
route to a webhook served by this test.

One run (module fixture) until the alert reaches the webhook; each test checks one link of the path: the
forwarded verdict span in the convicting step's trace, the alert's labels and links carrying that trace id,
Prometheus' exemplars, the labels after a default scrape, and every dashboard query and alert expression on the
run's data. Waits are generous bounds (a loaded machine passes), not latencies."""

from __future__ import annotations

import contextlib
import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from alerting_support import AlertStack, alert_stack
from stack_support import (
    STAGE,
    TRACE_EXPORTERS,
    Collector,
    StragglerFeed,
    TraceSink,
    alert_exprs,
    dashboard_exprs,
    promql_metric_names,
    run_collector,
    send_emitter_metrics,
    wait_until,
)

import otel_straggler_schema as s

pytestmark = pytest.mark.slow

JOB = "llama 70b/run-7"  # a space and a slash: the links must encode it
RANKS = 4
SLOW_RANK = 3


@dataclass
class Run:
    col: Collector
    st: AlertStack
    sinks: dict[str, TraceSink]
    alert: dict[str, Any]  # the webhook's firing StragglerDetected alert


def _verdict_spans(sink: TraceSink) -> list[Any]:
    return [sp for service, sp in sink.spans() if sp.name == s.SPAN_VERDICT]


def _attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("alert-to-trace")
    with contextlib.ExitStack() as stack:
        sinks = {name: stack.enter_context(TraceSink()) for name in TRACE_EXPORTERS}
        col = stack.enter_context(run_collector(tmp, trace_endpoints={k: v.endpoint for k, v in sinks.items()}))
        st = stack.enter_context(alert_stack(tmp, col.metrics, col.log))
        feed = StragglerFeed(col.otlp_grpc, ranks=RANKS, job=JOB)
        stack.callback(feed.shutdown)
        try:
            send_emitter_metrics(col.otlp_grpc, job=JOB)
            step = 0
            for step in range(8):
                feed.step(step, slow_factor=1.3)

            def fired() -> bool:
                nonlocal step
                if step < 60 and not all(_verdict_spans(k) for k in sinks.values()):
                    step += 1  # verdict spans leave with the next request: keep the job running
                    feed.step(step, slow_factor=1.3)
                return bool(st.hook.alerts("firing")) and all(_verdict_spans(k) for k in sinks.values())

            wait_until(fired, 300, interval_s=0.5, what="StragglerDetected at the webhook and verdict spans")
            send_emitter_metrics(col.otlp_grpc, job=JOB)  # a second point of every emitter counter for rate()
            wait_until(lambda: st.query(f'{s.M_GPU_LOST_SECONDS}{{training_job="{JOB}"}}'), 60,
                       what="the GPU-seconds-lost counter in Prometheus")
            firing = st.hook.alerts("firing")  # one alert, possibly in more than one notification
            assert len({a["fingerprint"] for a in firing}) == 1, firing
            yield Run(col, st, sinks, firing[0])
        except AssertionError as e:
            raise AssertionError(f"{e}{st.diag()}") from e


def _verdict(run: Run) -> Any:
    """The straggler verdict span of the slow rank, as the Jaeger forwarder received it."""
    spans = [sp for sp in _verdict_spans(run.sinks["otlp_grpc/jaeger"])
             if _attrs(sp)[s.EV_VERDICT] == s.VERDICT_STRAGGLER]
    assert len(spans) == 1, [_attrs(sp) for sp in spans]
    return spans[0]


def test_verdict_span_is_forwarded_in_the_convicting_steps_trace(run: Run) -> None:
    """Both forwarders (Jaeger, Tempo) got the verdict span, in the trace of the step where rank 3 was first
    convicted, under that step's train-step root, with rank, stage, attribution, deviation and cost; and nothing
    but the collector's own spans (the gateway sends the stage spans)."""
    span = _verdict(run)
    a = _attrs(span)
    step = a[s.EV_FIRST_STEP]
    assert a[s.EV_STEP] == step and a[s.EV_JOB] == JOB and a[s.EV_RANK] == SLOW_RANK and a[s.EV_STAGE] == STAGE
    assert a[s.EV_ATTRIBUTION] in s.ATTRIBUTIONS and a[s.EV_DEVIATION] > 0.2
    assert a[s.EV_GPU_SECONDS_PER_HOUR] > 0 and a[s.EV_STEP_TIME_LOST_MS] > 0
    assert span.trace_id == s.trace_id_for_step(JOB, step).to_bytes(16, "big")
    assert span.parent_span_id == s.job_step_span_id(JOB, step).to_bytes(8, "big")
    assert a[s.EV_FIRST_TRACE_ID] == span.trace_id.hex()
    tempo = [sp for sp in _verdict_spans(run.sinks["otlp_grpc/tempo"]) if sp.span_id == span.span_id]
    assert len(tempo) == 1 and tempo[0].trace_id == span.trace_id
    for sink in run.sinks.values():
        assert {service for service, _ in sink.spans()} == {"otel-straggler-collector"}


def test_alert_carries_the_way_to_the_trace(run: Run) -> None:
    """The webhook's alert: training job, rank, host, GPU, stage, attribution, first step and the trace id the
    collector forwarded the verdict span in; links to Tempo and Jaeger by that trace id and to the overview
    dashboard filtered to the job, cohort and rank."""
    span = _verdict(run)
    trace_id = span.trace_id.hex()
    labels, ann = run.alert["labels"], run.alert["annotations"]
    assert labels["training_job"] == JOB and labels["rank"] == str(SLOW_RANK) and labels["stage"] == STAGE
    assert labels["host"] == "node-0" and labels["gpu"] == f"GPU-{SLOW_RANK:04d}"
    assert labels["attribution"] == _attrs(span)[s.EV_ATTRIBUTION]
    assert labels["first_step"] == str(_attrs(span)[s.EV_FIRST_STEP])
    assert labels["trace_id"] == ann["trace_id"] == trace_id
    assert not any(k.startswith("exported_") for k in labels), labels
    assert ann["jaeger_url"] == f"http://127.0.0.1:16686/trace/{trace_id}"
    tempo = urllib.parse.urlsplit(ann["tempo_url"])
    assert tempo.netloc == "127.0.0.1:3000" and tempo.path == "/explore"
    pane = urllib.parse.parse_qs(tempo.query)["panes"][0]
    assert '"uid":"tempo"' in pane and f'"query":"{trace_id}"' in pane
    dash = urllib.parse.urlsplit(ann["dashboard_url"])
    assert dash.path == "/d/otel-straggler-overview/straggler-overview"
    q = urllib.parse.parse_qs(dash.query)
    assert q["var-job"] == [JOB] and q["var-rank"] == [str(SLOW_RANK)] and q["var-cohort"] == [labels["cohort"]]
    assert "Deviation" in ann["description"] and "n/a" not in ann["description"]


def test_prometheus_returns_the_convicted_steps_trace_id_as_exemplar(run: Run) -> None:
    """Prometheus scraped OpenMetrics and stored the trace-id exemplars of the verdict counter and of the
    GPU-seconds-lost counter: both are the convicting step's trace."""
    trace_id = _verdict(run).trace_id.hex()
    for expr in (f'{s.M_VERDICTS}{{training_job="{JOB}",verdict="straggler"}}',
                 f'{s.M_GPU_LOST_SECONDS}{{training_job="{JOB}",rank="{SLOW_RANK}"}}'):
        found = wait_until(lambda e=expr: run.st.exemplars(e), 60, what=f"exemplars of {expr}")
        ids = {ex["labels"]["trace_id"] for series in found for ex in series["exemplars"]}
        assert ids == {trace_id}, (expr, found)


def test_default_scrape_keeps_the_collectors_labels(run: Run) -> None:
    """With honor_labels false nothing is renamed: no exported_job / exported_instance, the training job in
    training_job, `job` / `instance` name the scraped collector, and no series has an empty label value."""
    assert not run.st.query('{exported_job!=""}') and not run.st.query('{exported_instance!=""}')
    series = run.st.query('{__name__=~"otel_straggler_.+"}')
    assert len(series) > 50
    assert {m["job"] for m in series} == {"otel-straggler-collector"}
    assert {m["instance"] for m in series} == {f"127.0.0.1:{run.col.metrics}"}
    assert {m["training_job"] for m in series if "training_job" in m} == {JOB}
    text = run.col.scrape()
    assert '=""' not in text and not re.search(r"[{,](job|instance)=", text)


def _substitute(expr: str) -> str:
    """A dashboard query as Grafana sends it, with the job selected and every cohort and rank."""
    job = re.sub(r"([\\.+*?()\[\]{}|^$])", r"\\\\\1", JOB)  # a regex matcher's value, escaped in PromQL
    return (expr.replace("$job", job).replace("$cohort", ".*").replace("$rank", ".*")
            .replace("$__rate_interval", "30s"))


def test_every_dashboard_query_returns_the_job(run: Run) -> None:
    """Every panel and variable query of every dashboard, run by the real Prometheus on this run's data, returns
    series, and those that name a training job name this one."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    empty, wrong = [], []
    for where, expr in exprs:
        rows = run.st.query(_substitute(expr))
        if not rows:
            empty.append(where)
        jobs = {r["training_job"] for r in rows if "training_job" in r}
        if jobs - {JOB}:
            wrong.append((where, jobs))
    assert not empty, f"dashboard queries with no result: {empty}"
    assert not wrong, wrong
    table = [e for w, e in exprs if "Active stragglers / A" in w]
    (row,) = run.st.query(_substitute(table[0]))
    assert row["rank"] == str(SLOW_RANK) and row["trace_id"] == _verdict(run).trace_id.hex()


def test_every_alert_expression_finds_its_series(run: Run) -> None:
    """StragglerDetected's expression returns the slow rank of this job; every other rule's metrics (the
    watcher's: collector up, job last seen, rejected / dropped spans, emitter drops) are present with the labels
    the rule aggregates by, so each can fire."""
    (detected,) = [e for w, e in alert_exprs() if w == "prometheus rule StragglerDetected"]
    rows = run.st.query(detected)
    assert [(r["training_job"], r["rank"]) for r in rows] == [(JOB, str(SLOW_RANK))]
    for where, expr in alert_exprs():
        for name in promql_metric_names(expr):
            found = run.st.query(name)
            assert found, f"{where}: no {name} series"
            if "training_job" in expr:
                assert {r.get("training_job") for r in found} == {JOB}, (where, name)
    assert run.st.query('up{job="otel-straggler-collector"} == 1')
    (links,) = run.st.query("otel_straggler:link_base_urls:info")
    assert links["grafana_url"] and links["jaeger_url"] and links["tempo_datasource"] == "tempo"
