"""The export child keeps off the training thread's core (``export_affinity``), read from the real child
through the OS. The "training" thread builds the sink pinned to one CPU; the child is spawned from another
thread (as from the readout thread) that may run anywhere."""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import replace

import pytest
from export_e2e_support import otlp_env
from export_otlp_receiver import GrpcReceiver
from export_rank_driver import identity, make_intervals

from otel_straggler.config import DEFAULTS, EmitterConfig
from otel_straggler.export.process_sink import ProcessSink

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


@pytest.fixture
def grpc_receiver():
    rcv = GrpcReceiver()
    yield rcv
    rcv.stop()


class _TrainingThread:
    """A live thread pinned to one CPU that builds the sink (as install_megatron does on the training thread)."""

    def __init__(self, cpu: int, **kw) -> None:
        self._built = threading.Event()
        self._done = threading.Event()
        self.sink: ProcessSink | None = None
        self._thread = threading.Thread(target=self._run, args=(cpu, kw))
        self._thread.start()
        assert self._built.wait(10.0)

    def _run(self, cpu: int, kw: dict) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        job = f"aff-{uuid.uuid4().hex[:6]}"
        self.sink = ProcessSink(identity(0, 1, job).resource_attributes(), rank=0, job_id=job, **kw)
        self._built.set()
        self._done.wait(30.0)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(10.0)


@pytest.mark.parametrize("affinity", ["auto", "all"])
def test_export_child_runs_off_the_training_core(monkeypatch: pytest.MonkeyPatch, grpc_receiver: GrpcReceiver,
                                                 affinity: str) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    for key, value in otlp_env(grpc_receiver.endpoint).items():
        monkeypatch.setenv(key, value)
    allowed = os.sched_getaffinity(0)
    train_cpu = max(allowed)
    training = _TrainingThread(train_cpu, config=replace(DEFAULTS, export_affinity=affinity))
    sink = training.sink
    assert sink is not None
    try:
        sink.submit(make_intervals(0, 0))  # spawns the child from this thread (affinity: every allowed CPU)
        assert sink.flush(10.0)  # acked: the child has read its header and set its affinity
        pid = sink.child_pid
        assert pid is not None
        child = os.sched_getaffinity(pid)
        if affinity == "auto":
            assert train_cpu not in child and child and child <= allowed
        else:
            assert child == allowed
    finally:
        sink.shutdown(5.0)
        training.stop()


def test_export_affinity_setting_parses() -> None:
    assert EmitterConfig.from_env({}).export_affinity == "auto"
    assert EmitterConfig.from_env({"OTEL_STRAGGLER_EXPORT_AFFINITY": "all"}).export_affinity == "all"
    bad = EmitterConfig.from_env({"OTEL_STRAGGLER_EXPORT_AFFINITY": "cpu3"})
    assert bad.export_affinity == "auto" and "export_affinity" in bad.config_errors
