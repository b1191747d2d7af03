"""The C hot path and the Python one do the same: the same random sequences of timer operations
(``hot_path_trace.py``) run on each, in a child process per implementation (the choice is made at import), and
the emitter's whole state after every operation, and the intervals shipped, must be equal.

The sequences reach what the unit tests reach one case at a time: nesting, unbalanced calls, reuse of adjacent
boundaries' events across the gap, sampled-out repeats, record and stream-lookup failures, an exhausted pool, a
full ring, quarantine, an injector, resets and ``elapsed()`` of running timers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_straggler import hot_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hot_path_trace import MUTANTS

HERE = Path(__file__).resolve().parent
SEEDS = 24
OPS = 500


def _traces(impl: str, mutant: str | None = None, seeds: int = SEEDS) -> list[dict]:
    env = dict(os.environ, OTEL_STRAGGLER_HOT_PATH=impl)
    env.pop("PARITY_MUTANT", None)
    if mutant:
        env["PARITY_MUTANT"] = mutant
    out = subprocess.run([sys.executable, str(HERE / "hot_path_trace.py"), "0", str(seeds), str(OPS)], env=env,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    return [json.loads(line) for line in out.splitlines()]


_NATIVE: list[dict] = []


def _native() -> list[dict]:
    if not _NATIVE:
        _NATIVE.extend(_traces("native"))
    return _NATIVE


def _first_difference(a: dict, b: dict) -> str | None:
    for i, (x, y) in enumerate(zip(a["trace"], b["trace"], strict=True)):
        if x != y:
            keys = [k for k in x if x[k] != y.get(k)]
            return (f"after op {i} {x['op']} (config {a['cfg']}; ops before: "
                    f"{[s['op'] for s in a['trace'][max(0, i - 6):i]]}): "
                    + "; ".join(f"{k}: C {x[k]} / Python {y[k]}" for k in keys))
    if a["intervals"] != b["intervals"]:
        return "the intervals shipped differ"
    if a["frames"] != b["frames"]:
        fa, fb = bytes.fromhex(a["frames"]), bytes.fromhex(b["frames"])
        at = next((i for i, (x, y) in enumerate(zip(fa, fb)) if x != y), min(len(fa), len(fb)))
        return f"the wire frames differ from byte {at} ({len(fa)} / {len(fb)} bytes)"
    if a["counters"] != b["counters"]:
        return f"the counters differ: C {a['counters']} / Python {b['counters']}"
    return None


@pytest.mark.skipif(hot_path.core is None, reason=f"the C hot path is not in use ({hot_path.REASON})")
def test_both_hot_paths_leave_the_same_state_after_every_operation() -> None:
    """... and hand the sink byte-identical wire frames, and end with the same counters."""
    native, python = _native(), _traces("python")
    assert [t["impl"] for t in native] == ["native"] * SEEDS
    assert [t["impl"] for t in python] == ["python"] * SEEDS
    # the sequences reach the cases that matter (else equal traces would say little)
    ops = {s["op"][0] for t in python for s in t["trace"]}
    assert {"start", "stop", "reset", "elapsed", "set_step", "drain", "raise_rec", "raise_stream"} <= ops
    last = [t["trace"][-1] for t in python]
    assert sum(s["c"]["dropped_ring_full"] for s in last) > 0
    assert sum(s["deg"].get("pool_exhausted", 0) for s in last) > 0
    assert sum(s["deg"].get("cuda_error", 0) for s in last) > 0
    assert sum(s["c"]["unbalanced"] for s in last) > 0
    # Megatron's misuse errors: raised on both paths by the same calls (a trace records each call's message)
    raised = {s["op"][3] for t in python for s in t["trace"] if s["op"][0] in ("start", "stop")}
    assert raised == {None, "timer has already been started", "timer is not started"}
    assert sum(1 for t in python for iv in t["intervals"] if iv[5] is not None) > 100  # device times
    for seed, (a, b) in enumerate(zip(native, python, strict=True)):
        diff = _first_difference(a, b)
        assert diff is None, f"seed {seed}: {diff}"


@pytest.mark.skipif(hot_path.core is None, reason=f"the C hot path is not in use ({hot_path.REASON})")
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_deliberate_mistake_in_one_implementation_is_caught(mutant: str) -> None:
    """Each mutant (``hot_path_trace.MUTANTS``: a counter skipped, a duration off by one, a wrong flag bit, the
    wrong repeat picked, the reuse gap's bound moved) applied to the Python implementation alone: the comparison
    above sees a difference on some seed."""
    native, python = _native(), _traces("python", mutant)
    diffs = [d for a, b in zip(native, python, strict=True) if (d := _first_difference(a, b)) is not None]
    assert diffs, f"mutant {mutant} went unseen"
