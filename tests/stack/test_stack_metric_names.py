"""Every metric a dashboard panel, a dashboard variable or an alert rule queries is one the straggler collector
exports: statically against the schema contract (``otel_straggler_schema`` M_* names, histogram series, emitter
re-exports), and live against the ``/metrics`` of a real collector fed one straggler through the OTel SDK."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from stack_support import (
    SCRAPE_SERIES,
    SLOW_RANK,
    StragglerFeed,
    alert_exprs,
    annotation_metric_names,
    dashboard_exprs,
    emitter_metric_names,
    exported_metric_names,
    promql_metric_names,
    run_collector,
    send_emitter_metrics,
    wait_until,
)

import otel_straggler_schema as s


def _queried() -> dict[str, list[str]]:
    """metric name -> where it is queried."""
    out: dict[str, list[str]] = {}
    for where, expr in dashboard_exprs() + alert_exprs():
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric name found in {expr!r}"
        for name in names:
            out.setdefault(name, []).append(where)
    annotations = annotation_metric_names()
    assert len(annotations) >= 2, "the StragglerDetected description queries deviation and cost"
    for where, name in annotations:
        out.setdefault(name, []).append(where)
    return out


@pytest.mark.parametrize(("expr", "expected"), [
    ("max by (job, cohort, rank) (otel_straggler_active) > 0", {"otel_straggler_active"}),
    ('sum by (le) (rate(a_bucket{job=~"$job", x="y z"}[$__rate_interval])) / on (le) group_left b_total',
     {"a_bucket", "b_total"}),
    ('label_replace(rate(x_total[5m]) > 0, "outcome", "dropped", "", "") or y offset 5m',
     {"x_total", "y"}),
    ("histogram_quantile(0.99, sum by (le, instance) (rate(h_bucket[1m])))", {"h_bucket"}),
    ("count(up == 1) or vector(0)", {"up"}),
    ('quantile by (stage_group) (0.5, m{measurement="device"}) - ignoring (rank) n', {"m", "n"}),
])
def test_promql_metric_name_parser(expr: str, expected: set[str]) -> None:
    assert promql_metric_names(expr) == expected


def test_known_names_follow_the_schema() -> None:
    known = exported_metric_names()
    assert s.M_STRAGGLER_ACTIVE in known and s.M_PROCESSING_SECONDS + "_bucket" in known
    assert s.M_EMITTER_PREFIX + "dropped_total" in emitter_metric_names()
    assert s.M_EMITTER_PREFIX + "pool_high_water" in emitter_metric_names()  # a gauge of unit 1: no suffix
    assert s.M_EMITTER_PREFIX + "readout_lag_seconds" in emitter_metric_names()  # unit s: _seconds


def test_every_queried_metric_is_exported_per_the_schema() -> None:
    queried = _queried()
    assert len(queried) >= 25
    unknown = {name: where for name, where in queried.items()
               if name not in exported_metric_names() | SCRAPE_SERIES}
    assert not unknown, f"metrics the collector does not export: {unknown}"


def test_the_straggler_metrics_are_all_used() -> None:
    """The dashboards and alerts show every straggler series the collector exports."""
    queried = _queried()
    for name in (s.M_STRAGGLER_ACTIVE, s.M_STRAGGLER_DEVIATION, s.M_STEP_TIME_LOST, s.M_GPU_LOST_RATIO,
                 s.M_GPU_LOST_SECONDS, s.M_VERDICTS, s.M_RANK_STAGE_SECONDS, s.M_RANK_DEVIATION, s.M_JOB_LAST_SEEN):
        assert name in queried, name


def _scraped_names(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        names.update(sample.name for sample in fam.samples)
    return names


@pytest.mark.slow
def test_live_collector_exports_every_queried_metric(tmp_path: Path) -> None:
    """Real collector subprocess, fed 8 ranks over OTLP/gRPC by the OTel SDK with rank 3 slow in
    forward-compute, plus every emitter self-metric over OTLP metrics; then its /metrics must name every metric
    a dashboard or an alert queries."""
    with run_collector(tmp_path) as col:  # configs/collector-compose.yaml on loopback ports
        feed = StragglerFeed(col.otlp_grpc)
        try:
            for step in range(8):
                feed.step(step, slow_factor=1.2)
            send_emitter_metrics(col.otlp_grpc)

            def straggler_seen() -> bool:
                return f'rank="{SLOW_RANK}"' in "\n".join(
                    ln for ln in col.scrape().splitlines() if ln.startswith(s.M_STRAGGLER_ACTIVE + "{"))

            wait_until(straggler_seen, 120, what="otel_straggler_active for the slow rank")
            text = col.scrape()
            scraped = _scraped_names(text)
        finally:
            feed.shutdown()
    missing = sorted(set(_queried()) - scraped - SCRAPE_SERIES)
    assert not missing, f"queried but absent from the live /metrics: {missing}"
    # The compose config's disabled forwarder never fails, and its evidence exporter wrote the verdict.
    failures = [ln for ln in text.splitlines() if ln.startswith(s.M_EXPORT_FAILURES + "{")]
    assert failures and all(ln.endswith(" 0.0") for ln in failures), failures  # there from the start, at 0
    verdicts = [json.loads(ln) for ln in col.evidence.read_text(encoding="utf-8").splitlines()]
    assert any(v["rank"] == SLOW_RANK and v["verdict"] == s.VERDICT_STRAGGLER for v in verdicts)
