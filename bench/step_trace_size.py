"""Step traces at scale: spans and bytes of one step's trace at 64, 1,024 and 8,192 ranks, how long Jaeger's query API
takes to return it and how large its answer is, and how long the Jaeger UI takes to render it in headless Chromium.

The trace is one training step of a Megatron-shaped job (TP 8, PP 1/4/4, DP 8/32/256) as the emitter sends it in its
default step detail: per rank 13 stage spans (five per-microbatch timers aggregated over 8 microbatches, eight
per-step timers) and the ``rank-step`` span with the step summary, rank 0's ``train-step`` root, on each rank's
Resource (``collector_processor/simulate/load.py`` encodes the emitter's shapes; ``tests/stack`` checks them). The
ranks' requests are sent over OTLP/gRPC to a real Jaeger v2 (``configs/jaeger.yaml``, in-memory store, a fresh one
per size): the gateway forwards stage spans to the trace stores unchanged, so what Jaeger stores is what any trace
store gets.

  OTEL_STRAGGLER_JAEGER_UI=<jaeger-ui build> python bench/step_trace_size.py        # ~5 min on 2 cores
  python bench/step_trace_size.py --sizes 64 --ui-sizes ""                           # smoke, no UI

One line per size: ranks, spans, otlp_bytes, api_ms (median of 3), api_json_bytes, ui_ms (time from navigation to
the trace's rows drawn and its span count shown; "-" when not measured, "timeout" past --ui-timeout-s)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "stack"))

LAYOUTS = {64: (8, 1, 8), 1024: (8, 4, 32), 8192: (8, 4, 256)}  # ranks -> (tp, pp, dp)
JOB = "bench-trace-size"
STEP = 7
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
MAX_REQUEST = 3 << 20  # under the OTLP receiver's 4 MiB gRPC default


def step_requests(ranks: int) -> list[bytes]:
    """One step of every rank, as OTLP ``ExportTraceServiceRequest`` bytes (several ranks per request)."""
    import otel_straggler_schema as s
    from collector_processor.simulate.job import Layout
    from collector_processor.simulate.load import LoadConfig, length_delimited, sdk_requests

    tp, pp, dp = LAYOUTS.get(ranks, (1, 1, ranks))
    cfg = LoadConfig(Layout(tp=tp, pp=pp, dp=dp), detail=s.DETAIL_STEP, job=JOB)
    per_rank = list(sdk_requests(cfg, range(STEP, STEP + 1)))
    # rank 0's train-step root: ResourceSpans of rank 0 with one span in the step scope
    root = (b"\x0a\x10" + s.trace_id_for_step(JOB, STEP).to_bytes(16, "big")
            + b"\x12\x08" + s.job_step_span_id(JOB, STEP).to_bytes(8, "big")
            + length_delimited(5, s.SPAN_JOB_STEP.encode()) + b"\x30\x01"
            + b"\x39" + (1_800_000_000_000_000_000 + STEP * 5 * 10**9).to_bytes(8, "little")
            + b"\x41" + (1_800_000_000_000_000_000 + STEP * 5 * 10**9 + 4 * 10**9).to_bytes(8, "little"))
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    first = ExportTraceServiceRequest.FromString(per_rank[0])
    res = first.resource_spans[0].resource.SerializeToString()
    scope = length_delimited(1, length_delimited(1, s.SCOPE_STEP_NAME.encode()))
    per_rank.append(length_delimited(1, length_delimited(1, res)
                                     + length_delimited(2, scope + length_delimited(2, root))))
    out, cur = [], b""
    for req in per_rank:  # repeated resource_spans: concatenated requests are one request
        if cur and len(cur) + len(req) > MAX_REQUEST:
            out.append(cur)
            cur = b""
        cur += req
    out.append(cur)
    return out


def measure(ranks: int, ui_assets: str | None, ui: bool, ui_timeout_s: float, shot: Path | None) -> dict:
    import grpc
    from engines_support import run_jaeger

    import otel_straggler_schema as s

    requests = step_requests(ranks)
    trace_id = f"{s.trace_id_for_step(JOB, STEP):032x}"
    with tempfile.TemporaryDirectory() as d, run_jaeger(Path(d), ui_assets=ui_assets) as jaeger:
        with grpc.insecure_channel(jaeger.otlp_grpc) as ch:
            export = ch.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
            for req in requests:
                export(req, timeout=60)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = sum(len(ss.spans) for req in requests
                    for rs in ExportTraceServiceRequest.FromString(req).resource_spans for ss in rs.scope_spans)
        url = f"{jaeger.url}/api/traces/{trace_id}"
        deadline = time.monotonic() + 300
        got = 0
        while time.monotonic() < deadline:  # Jaeger's batch processor and store take the spans in
            try:
                with urllib.request.urlopen(url, timeout=120) as r:
                    data = json.loads(r.read()).get("data") or []
            except urllib.error.HTTPError:  # 404 until the first span is stored
                data = []
            got = len(data[0]["spans"]) if data else 0
            if got >= spans:
                break
            time.sleep(1.0)
        times, size = [], 0
        for _ in range(3):
            t = time.perf_counter()
            with urllib.request.urlopen(url, timeout=120) as r:
                size = len(r.read())
            times.append((time.perf_counter() - t) * 1000)
        ui_ms: float | str = "-"
        if ui and ui_assets:
            from chromium_cdp import browser

            with browser(Path(d), width=1400, height=900, timeout_s=ui_timeout_s) as page:
                page.navigate("about:blank")
                t = time.perf_counter()
                page.navigate(f"{jaeger.url}/trace/{trace_id}")
                try:
                    page.wait_for("document.querySelectorAll('.span-row').length > 0 && "
                                  f"/Total Spans\\s*{got}/.test(document.body.innerText)", ui_timeout_s, 0.1)
                    ui_ms = (time.perf_counter() - t) * 1000
                except TimeoutError:
                    ui_ms = "timeout"
                if shot is not None:
                    page.screenshot(shot)
    return {"ranks": ranks, "spans": spans, "spans_in_jaeger": got, "otlp_bytes": sum(map(len, requests)),
            "api_ms": round(statistics.median(times)), "api_json_bytes": size,
            "ui_ms": ui_ms if isinstance(ui_ms, str) else round(ui_ms)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,1024,8192")
    p.add_argument("--ui-sizes", default="64,1024,8192", help="sizes whose UI render is timed (empty: none)")
    p.add_argument("--ui-timeout-s", type=float, default=240.0)
    p.add_argument("--screenshot-dir", type=Path, help="save the UI of each timed size here")
    args = p.parse_args()
    ui_assets = os.environ.get("OTEL_STRAGGLER_JAEGER_UI") or None
    ui_sizes = {int(x) for x in args.ui_sizes.split(",") if x}
    for ranks in (int(x) for x in args.sizes.split(",")):
        shot = args.screenshot_dir / f"step-trace-{ranks}.png" if args.screenshot_dir else None
        r = measure(ranks, ui_assets, ranks in ui_sizes, args.ui_timeout_s, shot)
        print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
