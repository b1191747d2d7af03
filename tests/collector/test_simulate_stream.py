"""The simulator's noise model: step time jitter common to a step's ranks (``Noise.step_jitter``)."""

from __future__ import annotations

import statistics

import otel_straggler_schema as s
from jobsim.stream import JobStream, Noise, SimConfig


def _forward_ms(noise: Noise, steps: int = 200) -> dict[int, dict[int, float]]:
    """step -> rank -> forward-compute device ms, from the stage spans the simulator sends."""
    out: dict[int, dict[int, float]] = {}
    stream = JobStream(SimConfig(steps=steps, noise=noise, step_summary=False, seed=4), [])
    for step, req in stream:
        for rs in req.resource_spans:
            rank = next(a.value.int_value for a in rs.resource.attributes if a.key == s.RES_RANK)
            for sp in rs.scope_spans[0].spans:
                attrs = {a.key: a.value for a in sp.attributes}
                if attrs.get(s.ATTR_STAGE) is not None and attrs[s.ATTR_STAGE].string_value == "forward-compute":
                    out.setdefault(step, {})[rank] = attrs[s.ATTR_DEVICE_MS].double_value
    return out


_QUIET = {"spike_prob": 0.0, "warmup_steps": 0, "late_ranks": 0, "missing_prob": 0.0}


def test_step_jitter_moves_every_rank_of_a_step_alike() -> None:
    got = _forward_ms(Noise(jitter=0.0, step_jitter=0.02, **_QUIET))
    per_step = []
    for ranks in got.values():
        vals = list(ranks.values())
        assert len(vals) >= 4 and max(vals) - min(vals) < 1e-9  # no per-rank noise: all ranks equal
        per_step.append(vals[0])
    rel = statistics.pstdev(per_step) / statistics.mean(per_step)
    assert 0.016 < rel < 0.024  # the step time jitters by ~2 %


def test_step_jitter_leaves_the_ranks_per_step_ratios_alone() -> None:
    plain = _forward_ms(Noise(jitter=0.01, **_QUIET))
    common = _forward_ms(Noise(jitter=0.01, step_jitter=0.02, **_QUIET))
    assert plain.keys() == common.keys()
    moved = 0
    for step, ranks in plain.items():
        c = common[step]
        moved += abs(c[0] / ranks[0] - 1.0) > 1e-6
        for r, v in ranks.items():  # same per-rank draws; one factor per step on all of them
            assert abs(c[r] / c[0] - v / ranks[0]) < 1e-9
    assert moved > len(plain) * 0.9
