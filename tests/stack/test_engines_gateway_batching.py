"""The sharded gateway (``configs/otelcol-gateway-sharded.yaml``, the real OpenTelemetry Collector) merges the
ranks' requests in its load balancer's queue before routing, so each straggler collector shard receives one
request per batch instead of one per rank (``bench/results/scale.md``: a shard spends a quarter of the CPU per
span on the merged requests).

Sixteen ranks (four cohorts) each send their step in a request of their own to the gateway, which routes by
cohort to two real shards. The shipped batch setting is kept; only its flush bounds are set so that the batch
closes when the last rank's spans are in (a size, not a time: the flush timeout is beyond the test)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import grpc
import pytest
import yaml
from engines_support import REPO, run_otelcol
from stack_support import collector_config, http_get, process, require_collector, wait_until

import otel_straggler_schema as s
from jobsim.job import Layout
from jobsim.load import LoadConfig, sdk_requests
from otel_straggler_demo.run import free_ports

pytestmark = pytest.mark.slow

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SHARDS = 2


def _total(url: str, name: str) -> float:
    from engines_support import metric_values

    code, body = http_get(url)
    return sum(v for _, v in metric_values(body.decode(), name)) if code == 200 else -1.0


def test_the_gateway_sends_each_shard_one_request_per_batch(tmp_path: Path) -> None:
    load = LoadConfig(Layout(dp=4, tp=4), detail=s.DETAIL_STEP)
    load.spans_per_request = load.spans_per_rank_step
    requests = list(sdk_requests(load, range(1, 2)))  # one request per rank
    spans = len(requests) * load.spans_per_rank_step
    argv = require_collector()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    ports = free_ports(3 * SHARDS + 2)
    with contextlib.ExitStack() as stack:
        metrics_urls = []
        for i in range(SHARDS):
            grpc_port, http_port, metrics = ports[3 * i: 3 * i + 3]
            cfg = collector_config(grpc_port, http_port, metrics, tmp_path / f"evidence{i}.jsonl")
            path = tmp_path / f"shard{i}.yaml"
            path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
            stack.enter_context(process([*argv, "--config", str(path)], tmp_path / f"shard{i}.log", env=env))
            metrics_urls.append(f"http://127.0.0.1:{metrics}/metrics")
        for url in metrics_urls:
            wait_until(lambda url=url: http_get(url)[0] == 200, 120, what=f"shard {url}")
        gw = yaml.safe_load((REPO / "configs" / "otelcol-gateway-sharded.yaml").read_text(encoding="utf-8"))
        gw["receivers"]["otlp"]["protocols"] = {"grpc": {"endpoint": f"127.0.0.1:{ports[-2]}"},
                                                "http": {"endpoint": f"127.0.0.1:{ports[-1]}"}}
        lb = gw["exporters"]["load_balancing/straggler"]
        lb["resolver"] = {"static": {"hostnames": [f"127.0.0.1:{ports[3 * i]}" for i in range(SHARDS)]}}
        queue = lb["sending_queue"]
        if queue.get("batch") is not None:  # the shipped batching, closed by size alone
            queue["batch"].update({"min_size": spans, "flush_timeout": "600s"})
        for store in ("otlp_grpc/jaeger", "otlp_grpc/tempo"):
            del gw["exporters"][store]
        gw["service"]["pipelines"]["traces"]["exporters"] = ["load_balancing/straggler"]
        gateway = stack.enter_context(run_otelcol(tmp_path, gw, name="gateway"))
        channel = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{ports[-2]}"))
        call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
        for raw in requests:
            call(raw, timeout=30)
        wait_until(lambda: sum(_total(u, s.M_SPANS_ACCEPTED) for u in metrics_urls) == spans, 60,
                   what=f"{spans} spans at the shards")
        per_shard = [_total(u, s.M_REQUESTS) for u in metrics_urls]
        assert gateway.proc.poll() is None
    assert len(requests) == 16 and sum(per_shard) <= SHARDS, per_shard
