"""Alerting end to end with the real programs: the straggler collector (subprocess), Prometheus scraping it and
evaluating ``configs/prometheus/rules/straggler.rules.yml``, Alertmanager routing to a webhook served by this
test. 8 ranks (one Resource + TracerProvider each) send stage spans through the OTel SDK's ``OTLPSpanExporter``;
rank 3 is 20 % slower in ``forward-compute`` for 8 steps, then back to par. ``StragglerDetected`` must fire with
``rank="3"`` (Alertmanager API and webhook), then resolve.

The only change to the shipped rules is ``for: 1m`` -> ``for: 2s`` (in a test copy) so the test runs in seconds;
the scrape and evaluation intervals are 1 s for the same reason. Waits are generous bounds (a loaded machine
passes), not latencies: each returns as soon as its condition holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from alerting_support import alert_stack
from stack_support import (
    DASHBOARDS,
    JOB_ID,
    SLOW_RANK,
    STAGE,
    StragglerFeed,
    dashboard_panels,
    run_collector,
    wait_until,
)

pytestmark = pytest.mark.slow


def _active_stragglers_table_has_one_row(st) -> None:  # type: ignore[no-untyped-def]
    """The overview's 'Active stragglers' table, its queries run by the real Prometheus: Grafana's merge
    transform joins rows whose label columns are equal, so every query must return the same label set (no
    metric name, no instance) for the straggler: one row, not one per query."""
    panels = dashboard_panels(DASHBOARDS / "straggler-overview.json")
    (table,) = [p for p in panels if p["title"] == "Active stragglers" and p["type"] == "table"]
    label_sets = []
    for target in table["targets"]:
        expr = target["expr"].replace('"$job"', '".*"').replace('"$cohort"', '".*"')
        rows = st.query(expr)
        assert len(rows) == 1, (target["refId"], rows)
        label_sets.append(rows[0])
    assert all(labels == label_sets[0] for labels in label_sets), label_sets
    assert label_sets[0]["rank"] == str(SLOW_RANK) and "__name__" not in label_sets[0]


def test_straggler_alert_fires_with_the_slow_rank_and_resolves(tmp_path: Path) -> None:
    with run_collector(tmp_path) as col, alert_stack(tmp_path, col.metrics, col.log) as st:
        try:
            feed = StragglerFeed(col.otlp_grpc)
            try:
                for step in range(8):
                    feed.step(step, slow_factor=1.2)
                firing = wait_until(st.active, 300, what="StragglerDetected in Alertmanager")
                (alert,) = firing
                labels = alert["labels"]
                assert labels["rank"] == str(SLOW_RANK) and labels["training_job"] == JOB_ID
                assert labels["stage"] == STAGE and labels["severity"] == "warning"
                assert labels["cohort"] == feed.cohort and labels["host"] and labels["gpu"]
                assert labels["attribution"] in ("gpu_stream_stall", "host_only_stall", "attribution_unknown")
                assert alert["annotations"]["runbook_url"].startswith("https://")
                assert "Deviation" in alert["annotations"]["description"]
                wait_until(lambda: st.hook.alerts("firing"), 120, what="firing webhook")
                assert {a["labels"]["rank"] for a in st.hook.alerts("firing")} == {str(SLOW_RANK)}
                _active_stragglers_table_has_one_row(st)

                for step in range(8, 20):  # back to par: a recovered verdict clears the gauge
                    feed.step(step, slow_factor=1.0)
                resolved = wait_until(lambda: st.hook.alerts("resolved"), 300, what="resolved webhook")
                assert {a["labels"]["rank"] for a in resolved} == {str(SLOW_RANK)}
                wait_until(lambda: not st.active(), 120, what="alert gone from Alertmanager")
            finally:
                feed.shutdown()
        except AssertionError as e:
            raise AssertionError(f"{e}{st.diag()}") from e
