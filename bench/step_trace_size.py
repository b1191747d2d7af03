"""Step traces at scale: spans and bytes of the trace an alert links to at 64, 1,024 and 8,192 ranks, how long
Jaeger's query API takes to return it and how large its answer is, and how long the Jaeger UI takes to render it in
headless Chromium; the same for the whole step as one trace (``--layouts one``), side by side in one run.

The step is one training step of a Megatron-shaped job (TP 8, PP 1/4/4, DP 8/32/256) as the emitter sends it in its
default step detail: per rank 13 stage spans (five per-microbatch timers aggregated over 8 microbatches, eight
per-step timers) and the ``rank-step`` span with the step summary, on each rank's Resource
(``jobsim/load.py`` encodes the emitter's shapes; ``tests/stack`` checks them), and the
``train-step`` root of each block of 64 ranks (docs/schema.md, trace-id rule). Layout ``blocks`` is the trace-id
rule: a trace per block, the measured trace the last rank's block (an alert's trace holds its rank's block). Layout
``one`` rewrites every span into block 0's trace under one root: a trace of the whole step, for comparison. The
ranks' requests go over OTLP/gRPC to a real Jaeger v2 (``configs/jaeger.yaml``, in-memory store, a fresh one per
size and layout): the gateway forwards stage spans to the trace stores unchanged, so what Jaeger stores is what any
trace store gets.

  OTEL_STRAGGLER_JAEGER_UI=<jaeger-ui build> python bench/step_trace_size.py        # ~8 min on 2 cores
  python bench/step_trace_size.py --sizes 64 --ui-sizes ""                           # smoke, no UI

One line per size and layout: ranks, layout, traces (per step), spans and otlp_bytes (the whole step),
trace_spans and trace_otlp_bytes (the measured trace), spans_in_jaeger, api_ms (median of 3), api_json_bytes, ui_ms
(from navigation to the trace's rows drawn and its span count shown; "-" when not measured, "timeout" past
--ui-timeout-s)."""

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


def _root(s, trace_id: int, block: int) -> bytes:
    """The ``train-step`` span of a block's trace (``Span`` fields 1 trace_id, 2 span_id, 5 name, 6 kind, 7/8
    times, 9 attributes)."""
    from jobsim.load import _kv_bytes, length_delimited

    t0 = 1_800_000_000_000_000_000 + STEP * 5 * 10**9
    return (b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + s.step_root_span_id(trace_id).to_bytes(8, "big")
            + length_delimited(5, s.SPAN_JOB_STEP.encode()) + b"\x30\x01" + b"\x39" + t0.to_bytes(8, "little")
            + b"\x41" + (t0 + 4 * 10**9).to_bytes(8, "little") + _kv_bytes(s.ATTR_TRACE_BLOCK, block))


def step_requests(ranks: int, layout: str) -> tuple[list[bytes], int, int, int]:
    """One step of every rank as OTLP ``ExportTraceServiceRequest`` bytes (several ranks per request), the measured
    trace's id, its spans and its bytes."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    import otel_straggler_schema as s
    from jobsim.job import Layout
    from jobsim.load import LoadConfig, length_delimited, sdk_requests

    tp, pp, dp = LAYOUTS.get(ranks, (1, 1, ranks))
    cfg = LoadConfig(Layout(tp=tp, pp=pp, dp=dp), detail=s.DETAIL_STEP, job=JOB)
    per_rank = list(sdk_requests(cfg, range(STEP, STEP + 1)))  # one request per rank, in rank order
    assert len(per_rank) == ranks
    scope = length_delimited(1, length_delimited(1, s.SCOPE_STEP_NAME.encode()))
    one_trace = s.trace_id_for_step(JOB, STEP)
    if layout == "one":  # every span into block 0's trace, every rank-step under its root
        root_id = s.step_root_span_id(one_trace).to_bytes(8, "big")
        for i, raw in enumerate(per_rank):
            req = ExportTraceServiceRequest.FromString(raw)
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        sp.trace_id = one_trace.to_bytes(16, "big")
                        if sp.name == s.SPAN_RANK_STEP:
                            sp.parent_span_id = root_id
            per_rank[i] = req.SerializeToString()
    blocks = 1 if layout == "one" else -(-ranks // s.STEP_TRACE_RANKS)
    for block in range(blocks):  # the first rank of each block sends its root, on that rank's Resource
        rank = block * s.STEP_TRACE_RANKS
        trace_id = one_trace if layout == "one" else s.trace_id_for_step(JOB, STEP, block=block)
        res = ExportTraceServiceRequest.FromString(per_rank[rank]).resource_spans[0].resource.SerializeToString()
        per_rank[rank] += length_delimited(1, length_delimited(1, res) + length_delimited(
            2, scope + length_delimited(2, _root(s, trace_id, block))))
    last = blocks - 1
    measured = one_trace if layout == "one" else s.trace_id_for_step(JOB, STEP, block=last)
    mine = per_rank if layout == "one" else per_rank[last * s.STEP_TRACE_RANKS:]
    trace_spans = sum(len(ss.spans) for req in mine
                      for rs in ExportTraceServiceRequest.FromString(req).resource_spans for ss in rs.scope_spans)
    out, cur = [], b""
    for req in per_rank:  # repeated resource_spans: concatenated requests are one request
        if cur and len(cur) + len(req) > MAX_REQUEST:
            out.append(cur)
            cur = b""
        cur += req
    out.append(cur)
    return out, measured, trace_spans, sum(map(len, mine))


def measure(ranks: int, layout: str, ui_assets: str | None, ui: bool, ui_timeout_s: float,
            shot: Path | None) -> dict:
    import grpc
    from engines_support import run_jaeger
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    import otel_straggler_schema as s

    requests, measured, trace_spans, trace_bytes = step_requests(ranks, layout)
    trace_id = f"{measured:032x}"
    spans = sum(len(ss.spans) for req in requests
                for rs in ExportTraceServiceRequest.FromString(req).resource_spans for ss in rs.scope_spans)
    with tempfile.TemporaryDirectory() as d, run_jaeger(Path(d), ui_assets=ui_assets) as jaeger:
        with grpc.insecure_channel(jaeger.otlp_grpc) as ch:
            export = ch.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
            for req in requests:
                export(req, timeout=60)
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
            if got >= trace_spans:
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
    return {"ranks": ranks, "layout": layout, "traces": 1 if layout == "one" else -(-ranks // s.STEP_TRACE_RANKS),
            "spans": spans, "otlp_bytes": sum(map(len, requests)), "trace_spans": trace_spans,
            "trace_otlp_bytes": trace_bytes, "spans_in_jaeger": got, "api_ms": round(statistics.median(times)),
            "api_json_bytes": size, "ui_ms": ui_ms if isinstance(ui_ms, str) else round(ui_ms)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,1024,8192")
    p.add_argument("--layouts", default="blocks,one", help="blocks (the trace-id rule), one (the step as one trace)")
    p.add_argument("--ui-sizes", default="64,1024,8192", help="sizes whose UI render is timed (empty: none)")
    p.add_argument("--ui-timeout-s", type=float, default=240.0)
    p.add_argument("--screenshot-dir", type=Path, help="save the UI of each timed size here")
    args = p.parse_args()
    ui_assets = os.environ.get("OTEL_STRAGGLER_JAEGER_UI") or None
    ui_sizes = {int(x) for x in args.ui_sizes.split(",") if x}
    for ranks in (int(x) for x in args.sizes.split(",")):
        for layout in args.layouts.split(","):
            shot = args.screenshot_dir / f"step-trace-{ranks}-{layout}.png" if args.screenshot_dir else None
            r = measure(ranks, layout, ui_assets, ranks in ui_sizes, args.ui_timeout_s, shot)
            print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
