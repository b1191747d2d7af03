"""What an operator sees: the verdict's step trace in the Jaeger UI, rendered by headless Chromium.

The README's "See it" path on the real programs: a 4-rank job (one Resource + TracerProvider per rank, stage spans
through the OTel SDK's ``OTLPSpanExporter`` over gRPC) runs rank 3 50 % slow in ``forward-compute``; the straggler
collector runs ``configs/collector.yaml`` (short windows, as the other stack tests) forwarding every span to a
real Jaeger v2 serving the Jaeger UI. The verdict's ``straggler.first_trace_id`` (the evidence line) makes the
link the alert rules build (``<jaeger_url>/trace/<trace_id>``); Chromium opens it through the DevTools protocol
(``chromium_cdp.py``), expands the ``straggler.verdict`` span, reads the rendered page and saves a screenshot
(``OTEL_STRAGGLER_SCREENSHOT``: where to write it; ``docs/images/jaeger-step-trace.png`` is one).

The UI's built assets come from ``OTEL_STRAGGLER_JAEGER_UI`` (the ``build`` folder of jaeger-ui at the tag of
the Jaeger release ``scripts/engines`` pins, built with ``npm ci && npm run build``): the Jaeger Go module carries
only a placeholder for them and they are on no package registry a CI machine reaches, so without that variable,
or without a Chromium (Debian ``chromium``), the test skips with the reason. Waits are generous bounds for a
loaded machine, not latencies."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from chromium_cdp import browser, chromium
from engines_support import run_jaeger
from stack_support import (
    CONFIGS,
    QUICK_STRAGGLER,
    STAGE,
    StragglerFeed,
    http_get,
    process,
    require_collector,
    tail,
    wait_until,
)

import otel_straggler_schema as s
from otel_straggler_demo.run import free_ports

pytestmark = pytest.mark.slow

ENV_UI = "OTEL_STRAGGLER_JAEGER_UI"
ENV_SCREENSHOT = "OTEL_STRAGGLER_SCREENSHOT"
JOB = "llama 8b/run-2"
RANKS = 4
SLOW_RANK = 3  # StragglerFeed's slow rank
FEED_STAGES = (STAGE, "backward-compute", "all-grads-sync")  # the stages StragglerFeed emits per rank-step


def _ui_assets() -> str:
    path = os.environ.get(ENV_UI, "")
    if not path:
        pytest.skip(f"{ENV_UI} is not set: the Jaeger UI's built assets are not in the Jaeger Go module (a "
                    "placeholder only) nor on a package registry; build jaeger-ui at the pinned Jaeger tag "
                    "(npm ci && npm run build in packages/jaeger-ui) and point the variable at its build folder")
    if not (Path(path) / "index.html").is_file():
        pytest.fail(f"{ENV_UI}={path} has no index.html: not a built Jaeger UI")
    return path


def _verdicts(evidence: Path) -> list[dict[str, Any]]:
    if not evidence.exists():
        return []
    lines = [json.loads(line) for line in evidence.read_text(encoding="utf-8").splitlines()]
    return [rec for rec in lines if rec["verdict"] == s.VERDICT_STRAGGLER]


@contextlib.contextmanager
def _see_it_collector(tmp: Path, jaeger_otlp: str) -> Any:
    """configs/collector.yaml as the README runs it (every span forwarded to Jaeger), windows shortened."""
    cfg = yaml.safe_load((CONFIGS / "collector.yaml").read_text(encoding="utf-8"))
    cfg["processors"]["straggler"] = dict(QUICK_STRAGGLER)
    path = tmp / "collector.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    grpc, http_port, metrics = free_ports(3)
    evidence = tmp / "evidence" / "verdicts.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_STRAGGLER_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{grpc}",
                "OTEL_STRAGGLER_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}",
                "OTEL_STRAGGLER_METRICS_ENDPOINT": f"127.0.0.1:{metrics}",
                "OTEL_STRAGGLER_TRACES_ENDPOINT": jaeger_otlp,
                "OTEL_STRAGGLER_EVIDENCE_PATH": str(evidence)})
    log = tmp / "collector.log"
    with process([*require_collector(), "--config", str(path)], log, env=env) as proc:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"collector exited with {proc.returncode}:\n{tail(log)}")
            return http_get(f"http://127.0.0.1:{metrics}/metrics")[0] == 200

        wait_until(ready, 120, what="collector /metrics")
        yield grpc, evidence, log


def test_the_verdicts_trace_renders_in_the_jaeger_ui(tmp_path: Path) -> None:
    assets = _ui_assets()
    chromium()
    with contextlib.ExitStack() as stack:
        jaeger = stack.enter_context(run_jaeger(tmp_path, ui_assets=assets))
        grpc, evidence, log = stack.enter_context(_see_it_collector(tmp_path, jaeger.otlp_grpc))
        feed = StragglerFeed(grpc, ranks=RANKS, job=JOB)
        feed.t_ns = time.time_ns() - 2 * 10**9  # 1-s steps from 2 s ago: the verdict lands seconds after its step
        stack.callback(feed.shutdown)

        step = -1

        def convicted() -> list[dict[str, Any]]:
            nonlocal step
            if step < 60:
                step += 1
                feed.step(step, slow_factor=1.5)
            return _verdicts(evidence)

        verdict = wait_until(convicted, 300, interval_s=0.3, what="a straggler verdict in the evidence")[0]
        assert verdict["rank"] == SLOW_RANK and verdict["stage"] == STAGE, verdict
        trace_id = verdict["first_trace_id"]
        first_step = int(verdict["first_step"])
        assert trace_id == f"{s.trace_id_for_step(JOB, first_step):032x}", verdict
        expected = RANKS * (1 + len(FEED_STAGES)) + 2  # rank-steps and stages, train-step, verdict

        def complete() -> bool:
            if step < 60:  # verdict spans leave with the next request: keep the job running
                feed.step(step + 1, slow_factor=1.5)
            return len(jaeger.trace(trace_id)) == expected

        wait_until(complete, 120, interval_s=0.5, what=f"{expected} spans of trace {trace_id} in Jaeger")

        link = f"{jaeger.url}/trace/{trace_id}"  # what the rules' jaeger_url annotation holds, on this base
        page = stack.enter_context(browser(tmp_path, width=1400, height=1500))
        page.navigate(link)
        page.wait_for(f"document.querySelectorAll('.span-row').length >= {expected}", 60)
        rows = page.evaluate("[...document.querySelectorAll('.span-row .endpoint-name')].map(e => e.textContent)")
        header = page.evaluate("document.querySelector('.TracePageHeader--overviewItems, .TracePageHeader') "
                               "&& document.querySelector('.TracePageHeader--overviewItems, .TracePageHeader')"
                               ".innerText")
        # the verdict span, expanded with its attributes (the tags table open)
        page.evaluate("[...document.querySelectorAll('.span-row .span-name')]"
                      f".find(e => e.textContent.includes('{s.SPAN_VERDICT}')).click()")
        page.wait_for("document.querySelector('.detail-row') !== null", 30)
        page.evaluate("[...document.querySelectorAll('.detail-row .AccordianKeyValues--header')]"
                      ".find(e => e.textContent.includes('Tags')).click()")
        page.wait_for("document.querySelector('.detail-row .KeyValueTable') !== null", 30)
        detail = page.evaluate("document.querySelector('.detail-row').innerText")
        shot = Path(os.environ.get(ENV_SCREENSHOT) or tmp_path / "jaeger-step-trace.png")
        time.sleep(0.5)  # the expanded row's layout settles before the capture
        page.screenshot(tmp_path / "capture.png")
        if shot != tmp_path / "capture.png":
            shot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tmp_path / "capture.png", shot)

    assert sorted(rows) == sorted([s.SPAN_JOB_STEP, s.SPAN_VERDICT] + [s.SPAN_RANK_STEP] * RANKS
                                  + list(FEED_STAGES) * RANKS), rows
    assert re.search(rf"Total Spans\s*{expected}\b", header or ""), header
    assert re.search(rf"(^|\s){re.escape(s.EV_RANK)}\s*{SLOW_RANK}\s", detail), detail
    assert re.search(rf"{re.escape(s.EV_STAGE)}\s*{STAGE}", detail), detail
    assert re.search(rf"{re.escape(s.EV_VERDICT)}\s*{s.VERDICT_STRAGGLER}", detail), detail
    png = (tmp_path / "capture.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, len(png)
    assert {v["rank"] for v in _verdicts(evidence)} == {SLOW_RANK}, tail(log)
