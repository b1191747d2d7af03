"""Zero-code Megatron (``otel_straggler/instrumentation.py``): the ``opentelemetry_instrumentor`` entry point, the
patches on real megatron-core, and a real ``opentelemetry-instrument`` run whose spans reach an OTLP receiver even
with ``OTEL_TRACES_SAMPLER=always_off``.

megatron-core (the pip package) has no ``megatron.training``; Megatron-LM's ``global_vars`` is written here in its
shape (``from megatron.core.timers import Timers``; ``_set_timers(args)`` assigns ``_GLOBAL_TIMERS``), next to the
real ``megatron.core`` (``megatron`` is a namespace package, so both load as one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from export_e2e_support import ROOT, otlp_env
from export_otlp_receiver import GrpcReceiver

import otel_straggler_schema as schema

pytest.importorskip("megatron.core")

MEGATRON_LM_GLOBAL_VARS = '''
"""Megatron-LM's megatron/training/global_vars.py, as far as the timers go."""
from megatron.core.timers import Timers

_GLOBAL_TIMERS = None


def get_timers():
    assert _GLOBAL_TIMERS is not None, "timers is not initialized."
    return _GLOBAL_TIMERS


def _set_timers(args):
    global _GLOBAL_TIMERS
    assert _GLOBAL_TIMERS is None, "timers is already initialized."
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)
'''

# A training script as Megatron-LM's pretrain_gpt.py runs it: nothing of otel_straggler in it.
PRETRAIN = '''
import json, sys, time, types
from megatron.training import global_vars

global_vars._set_timers(types.SimpleNamespace(timing_log_level=2, timing_log_option="all"))
timers = global_vars.get_timers()
for iteration in range(8):
    timers("forward-backward", log_level=1).start()
    for _ in range(2):
        timers("forward-compute", log_level=2).start()
        time.sleep(0.003)
        timers("forward-compute").stop()
    timers("forward-backward").stop()
    timers("optimizer", log_level=1).start()
    time.sleep(0.001)
    timers("optimizer").stop()
kind = type(timers).__module__ + "." + type(timers).__name__
ok = timers.flush(10.0) if hasattr(timers, "flush") else None
print(json.dumps({"timers": kind, "flushed": ok, "log_option": timers._log_option}), flush=True)
'''


@pytest.fixture
def megatron_lm(tmp_path: Path) -> Path:
    pkg = tmp_path / "megatron" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "global_vars.py").write_text(MEGATRON_LM_GLOBAL_VARS)
    (tmp_path / "pretrain_gpt.py").write_text(PRETRAIN)
    return tmp_path


def _run(code: str, cwd: Path, env: dict[str, str], argv: list[str] | None = None) -> dict:
    cmd = argv or [sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(megatron_lm: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PYTHONPATH"))}
    env["PYTHONPATH"] = os.pathsep.join([str(megatron_lm), str(ROOT)])
    env.update(extra)
    return env


def test_the_instrumentor_is_an_opentelemetry_instrumentor_entry_point() -> None:
    from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

    (ep,) = entry_points(group="opentelemetry_instrumentor", name="otel_straggler")
    cls = ep.load()
    assert issubclass(cls, BaseInstrumentor)
    assert list(cls().instrumentation_dependencies()) == []  # Megatron-LM checkouts carry no package metadata


INSTRUMENT_AND_RESTORE = '''
import json, types
import megatron.core, megatron.core.timers as mt
from megatron.training import global_vars as gv
from otel_straggler.instrumentation import MegatronInstrumentor
from otel_straggler.interval import NullSink
import otel_straggler

original = mt.Timers
gv._set_timers(types.SimpleNamespace(timing_log_level=1, timing_log_option="max"))  # built before instrument()
before = gv.get_timers()
inst = MegatronInstrumentor()
inst.instrument(sink=NullSink(), start_readout=False, register_lifecycle=False)
out = {
    "swapped": type(gv.get_timers()).__module__, "level": gv.get_timers()._log_level,
    "option": gv.get_timers()._log_option, "same_name": mt.Timers is megatron.core.Timers is gv.Timers,
    "subclass": issubclass(mt.Timers, original), "new": type(mt.Timers(2, "minmax")).__module__,
    "default_is_new": otel_straggler.get_timers() is not None,
}
inst.uninstrument()
out.update(restored_names=mt.Timers is original and megatron.core.Timers is original and gv.Timers is original,
           restored_global=gv.get_timers() is before, after=type(mt.Timers(2, "minmax")).__module__,
           default_after=otel_straggler.get_timers() is None)
print(json.dumps(out))
'''


def test_instrument_patches_megatron_and_uninstrument_restores_it(megatron_lm: Path) -> None:
    out = _run(INSTRUMENT_AND_RESTORE, megatron_lm, _env(megatron_lm, OTEL_STRAGGLER_ENABLED="1"))
    assert out["swapped"] == "otel_straggler.timers", "timers built before instrument() are swapped in place"
    assert (out["level"], out["option"]) == (1, "max"), "the swapped timers keep Megatron's log level and option"
    assert out["same_name"] and out["subclass"]
    assert out["new"] == "otel_straggler.timers"
    assert out["default_is_new"]
    assert out["restored_names"] and out["restored_global"], out
    assert out["after"] == "megatron.core.timers"
    assert out["default_after"]


def test_disabled_instrument_patches_nothing(megatron_lm: Path) -> None:
    code = '''
    import json
    import megatron.core.timers as mt
    original = mt.Timers
    from otel_straggler.instrumentation import MegatronInstrumentor
    MegatronInstrumentor().instrument()
    print(json.dumps({"untouched": mt.Timers is original, "kind": type(mt.Timers(2, "minmax")).__module__}))
    '''
    out = _run(code, megatron_lm, _env(megatron_lm))  # OTEL_STRAGGLER_ENABLED unset
    assert out == {"untouched": True, "kind": "megatron.core.timers"}


def _opentelemetry_instrument() -> str:
    path = Path(sys.executable).with_name("opentelemetry-instrument")
    if not path.exists():
        pytest.skip("opentelemetry-instrument is not installed next to this Python")
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["always_off", "traceidratio"])
def test_opentelemetry_instrument_times_an_unchanged_megatron_script(megatron_lm: Path, sampler: str) -> None:
    """``OTEL_STRAGGLER_ENABLED=1 opentelemetry-instrument python pretrain_gpt.py``: Megatron's global timers are the
    straggler timers, and every step's spans arrive although the user's sampler would drop them all (or most)."""
    rcv = GrpcReceiver()
    try:
        job = f"instr-{uuid.uuid4().hex[:6]}"
        env = _env(megatron_lm, **{k: v for k, v in otlp_env(rcv.endpoint).items() if k.startswith("OTEL_")})
        env.update(OTEL_STRAGGLER_ENABLED="1", OTEL_STRAGGLER_JOB_ID=job, OTEL_TRACES_SAMPLER=sampler,
                   OTEL_TRACES_SAMPLER_ARG="0.01")
        out = _run("", megatron_lm, env, [_opentelemetry_instrument(), sys.executable, "pretrain_gpt.py"])
        assert out["timers"] == "otel_straggler.timers.Timers"
        assert out["log_option"] == "all" and out["flushed"] is True
        spans = [sp for sp in rcv.store.spans() if sp.r(schema.RES_JOB_ID) == job]
        forward = {sp.a(schema.ATTR_ITERATION) for sp in spans if sp.name == "forward-compute"}
        # the auto step advances at each forward-backward start; the last step may still be open at exit
        assert len(forward) >= 7, sorted(forward)
        assert {sp.a(schema.ATTR_COUNT) for sp in spans if sp.name == "forward-compute"} == {2}
    finally:
        rcv.stop()


@pytest.mark.slow
def test_opentelemetry_instrument_without_the_switch_leaves_megatron_alone(megatron_lm: Path) -> None:
    # (Megatron's own timers synchronize CUDA when they stop: on this CPU-only machine they are only built)
    code = ("import json, types; from megatron.training import global_vars as gv; "
            "gv._set_timers(types.SimpleNamespace(timing_log_level=2, timing_log_option='all')); "
            "print(json.dumps({'timers': type(gv.get_timers()).__module__}))")
    out = _run("", megatron_lm, _env(megatron_lm), [_opentelemetry_instrument(), sys.executable, "-c", code])
    assert out["timers"] == "megatron.core.timers"
