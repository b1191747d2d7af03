"""Alerting end to end with the real programs: the straggler collector (subprocess), Prometheus scraping it and
evaluating ``configs/prometheus/rules/straggler.rules.yml``, Alertmanager routing to a webhook served by this
test. 8 ranks (one Resource + TracerProvider each) send stage spans through the OTel SDK's ``OTLPSpanExporter``;
rank 3 is 20 % slower in ``forward-compute`` for 8 steps, then back to par. ``StragglerDetected`` must fire with
``rank="3"`` (Alertmanager API and webhook), then resolve.

The only change to the shipped rules is ``for: 1m`` -> ``for: 2s`` (in a test copy) so the test runs in seconds;
the scrape and evaluation intervals are 1 s for the same reason."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from alerting_support import alert_stack
from stack_support import JOB_ID, SLOW_RANK, STAGE, StragglerFeed, run_collector, wait_until

pytestmark = pytest.mark.slow


def test_straggler_alert_fires_with_the_slow_rank_and_resolves(tmp_path: Path) -> None:
    started = time.monotonic()
    with run_collector(tmp_path) as col, alert_stack(tmp_path, col.metrics, col.log) as st:
        try:
            feed = StragglerFeed(col.otlp_grpc)
            try:
                for step in range(8):
                    feed.step(step, slow_factor=1.2)
                firing = wait_until(st.active, 40, what="StragglerDetected in Alertmanager")
                (alert,) = firing
                labels = alert["labels"]
                assert labels["rank"] == str(SLOW_RANK) and labels["job"] == JOB_ID
                assert labels["stage"] == STAGE and labels["severity"] == "warning"
                assert labels["cohort"] == feed.cohort and labels["host"] and labels["gpu"]
                assert labels["attribution"] in ("gpu_stream_stall", "host_only_stall", "attribution_unknown")
                assert alert["annotations"]["runbook_url"].startswith("docs/runbook.md#")
                assert "Deviation" in alert["annotations"]["description"]
                wait_until(lambda: st.hook.alerts("firing"), 15, what="firing webhook")
                assert {a["labels"]["rank"] for a in st.hook.alerts("firing")} == {str(SLOW_RANK)}

                for step in range(8, 20):  # back to par: a recovered verdict clears the gauge
                    feed.step(step, slow_factor=1.0)
                resolved = wait_until(lambda: st.hook.alerts("resolved"), 40, what="resolved webhook")
                assert {a["labels"]["rank"] for a in resolved} == {str(SLOW_RANK)}
                wait_until(lambda: not st.active(), 15, what="alert gone from Alertmanager")
            finally:
                feed.shutdown()
        except AssertionError as e:
            raise AssertionError(f"{e}{st.diag()}") from e
    assert time.monotonic() - started < 90
