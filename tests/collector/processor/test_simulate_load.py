"""The scale benches' load (``jobsim.load``): one slow rank injected into the encoded
requests is the one the straggler processor convicts, on the stage it was slowed in."""

from __future__ import annotations

import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import otel_straggler_schema as s
from collector_processor.processor.straggler import factory
from collector_processor.processor.straggler.config import Config
from collector_processor.telemetry import Telemetry
from jobsim.job import Layout
from jobsim.load import LoadConfig, sdk_requests


def _verdicts(cfg: LoadConfig, steps: int) -> list:
    out: list = []
    proc = factory.create_processor(Config(), Telemetry(), out.extend)  # the shipped detector settings
    proc.start()
    for raw in sdk_requests(cfg, range(1, steps + 1)):
        proc.process_traces(ExportTraceServiceRequest.FromString(raw))
    proc.tick(time.time())
    return [v for v in out if v.verdict == s.VERDICT_STRAGGLER]


def _load(**slow: object) -> LoadConfig:
    cfg = LoadConfig(Layout(dp=8, tp=2), detail=s.DETAIL_STEP, **slow)  # type: ignore[arg-type]
    cfg.spans_per_request = cfg.spans_per_rank_step
    return cfg


def test_the_injected_slow_rank_is_convicted_on_its_stage() -> None:
    found = _verdicts(_load(slow_rank=5, slow_factor=1.5, slow_from=3), 30)
    assert found and {v.rank for v in found} == {5}, [(v.rank, v.stage) for v in found]
    assert {v.stage for v in found} == {"forward-compute"}


def test_without_a_slow_rank_nobody_is_convicted() -> None:
    assert _verdicts(_load(), 30) == []
