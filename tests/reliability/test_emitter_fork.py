"""Forked DataLoader workers (real torch DataLoader, num_workers=2, fork start method) neither export duplicate
spans nor deadlock the trainer: a real export child, a real OTLP receiver."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "emitter"))
from export_e2e_support import otlp_env
from export_otlp_receiver import GrpcReceiver

import otel_straggler_schema as schema

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def test_dataloader_fork_workers_export_nothing_and_never_hang() -> None:
    rcv = GrpcReceiver()
    try:
        job = f"fork-{uuid.uuid4().hex[:6]}"
        env = otlp_env(rcv.endpoint, OTEL_METRIC_EXPORT_INTERVAL="60000")
        # a deadlock in a worker or at exit would hit this bound
        out = subprocess.run([sys.executable, str(HERE / "fork_driver.py"), json.dumps({"job": job})], env=env,
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["flush"] is True and res["steps"] == 32
        spans = [sp for sp in rcv.store.spans() if sp.r(schema.RES_JOB_ID) == job]
        assert spans
        assert {sp.r(schema.RES_PROCESS_PID) for sp in spans} == {res["pid"]}  # only the trainer exported
        assert not [sp for sp in spans if sp.name == "worker-load"]  # workers' timings stayed in their copies
        ids = [sp.span_id for sp in spans]
        assert len(ids) == len(set(ids))  # no duplicates
        fwd = sorted(sp.a(schema.ATTR_ITERATION) for sp in spans if sp.name == "forward-compute")
        assert fwd == list(range(1, 33))  # exactly one span per step
    finally:
        rcv.stop()
