"""The demo's report from synthetic evidence (no processes): the banner says what was found or why not, every
reason is explained in plain words, the heat map uses the verdicts' reference (the fastest other rank), the
y-axis holds the bulk of the data (a warm-up spike does not flatten it), and no two labels overlap."""

from __future__ import annotations

import itertools
import random
from html import escape as html_escape
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import otel_straggler_schema as s
from otel_straggler_demo.options import DemoOptions, Detection, describe_injection
from otel_straggler_demo.outcome import explain, stage_series
from otel_straggler_demo.report import (
    build_figure,
    outcome_line,
    robust_limits,
    window_deviation_grid,
    write_report,
)
from otel_straggler_demo.tap import StagePoint

OPTS = DemoOptions(ranks=8, steps=120, inject_rank=3, inject_from=50, inject_until=90)


def _points() -> list[StagePoint]:
    rng = random.Random(1)
    pts = []
    for r in range(8):
        for st in range(1, 121):
            ms = 100 * (1 + rng.gauss(0, 0.01)) + (10 if r == 3 and 50 <= st < 90 else 0)
            if st == 1:
                ms += 300  # warm-up spike
            pts.append(StagePoint(r, "forward-compute", "forward", st, ms, None))
    return pts


def _verdicts() -> list[dict]:
    out = [{"rank": 3, "stage": "forward-compute", "verdict": s.VERDICT_STRAGGLER, "reason": "slower_than_reference",
            "step": 59, "deviation": 0.1, "reference_rank": 6, "attribution": "host_only_stall"},
           {"rank": 3, "stage": "forward-compute", "verdict": s.VERDICT_RECOVERED, "reason": "within_tolerance",
            "step": 94, "deviation": 0.01, "reference_rank": 6, "attribution": "host_only_stall"}]
    out += [{"rank": r, "stage": stage, "verdict": s.VERDICT_UNCERTAIN, "reason": "below_absolute_floor", "step": 120,
             "deviation": 0.2, "reference_rank": 0, "attribution": "host_only_stall"}
            for r in range(8) for stage in ("batch-generator", "optimizer")]
    return out


def _hit() -> Detection:
    return Detection(rank=3, stage="forward-compute", verdict="straggler", deviation=0.1, steps_to_detect=9,
                     attribution="host_only_stall", step=59, injected=True, recovered_step=94, reference_rank=6)


def test_heat_map_cells_are_deviations_from_the_fastest_other_rank() -> None:
    series = {0: {1: 100.0, 2: 100.0}, 1: {1: 104.0, 2: 104.0}, 2: {1: 110.0, 2: 110.0}}
    ranks, windows, grid = window_deviation_grid(series, 5, fastest_quantile=0.1)
    assert ranks == [0, 1, 2] and windows == [0]
    assert grid[2][0] == pytest.approx(0.10) and grid[1][0] == pytest.approx(0.04)
    assert grid[0][0] == pytest.approx(100 / 104 - 1)  # the fastest rank against the next fastest
    # > 10 peers: the reference is the one at the 10th percentile of the others (index floor(0.1 * 20) = 2)
    many = {r: {1: float(r + 1)} for r in range(22)}  # rank r at r + 1 ms
    _, _, grid = window_deviation_grid(many, 5, fastest_quantile=0.1)
    assert grid[21][0] == pytest.approx(22.0 / 3.0 - 1)  # peers 1..21 ms: the reference is 3 ms
    assert grid[0][0] == pytest.approx(1.0 / 4.0 - 1)  # peers 2..22 ms: the reference is 4 ms


def test_y_axis_ignores_a_warm_up_spike() -> None:
    series = stage_series(_points(), "forward-compute")
    lo, hi = robust_limits([v for r in series for st, v in series[r].items() if st >= 10])
    assert 90 < lo < 100 and 110 < hi < 130  # the 400 ms first step is outside


def test_banner_and_plain_reasons_when_nothing_was_found(tmp_path: Path) -> None:
    problems = ["not detected: rank 3 forward-compute (slowed from step 50) was never convicted: the detector said "
                "8 x uncertain/below_absolute_floor (...)"]
    html, png = write_report(tmp_path, _points(), _verdicts()[2:], OPTS, [], problems)
    page = Path(html).read_text(encoding="utf-8")
    assert "FAILED: not detected: rank 3 forward-compute" in page
    assert html_escape(explain("below_absolute_floor")) in page and "What the reasons mean" in page
    assert Path(png).stat().st_size > 10_000
    assert outcome_line(DemoOptions(inject_rank=None), [], [], external=False) == \
        "No straggler injected, none detected."


def test_banner_when_found(tmp_path: Path) -> None:
    html, _ = write_report(tmp_path, _points(), _verdicts(), OPTS, [_hit()], [])
    page = Path(html).read_text(encoding="utf-8")
    assert "Found: rank 3 forward-compute +10.0% at step 59, 9 steps after its slowdown began" in page
    assert html_escape(explain("within_tolerance")) in page and html_escape(explain("slower_than_reference")) in page


def test_no_two_labels_overlap() -> None:
    fig = build_figure(_points(), _verdicts(), OPTS, [_hit()], outcome_line(OPTS, [_hit()], [], False),
                       failed=False)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = []
    if fig._suptitle is not None:  # matplotlib keeps the suptitle there
        boxes.append(("suptitle", fig._suptitle.get_window_extent(renderer)))
    for i, ax in enumerate(fig.axes):
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels(), *ax.texts]
        boxes += [(f"axes {i}: {t.get_text()!r}", t.get_window_extent(renderer))
                  for t in texts if t.get_visible() and t.get_text().strip()]
        legend = ax.get_legend()
        if legend is not None:
            boxes.append((f"axes {i}: legend", legend.get_window_extent(renderer)))
            for j, other in enumerate(fig.axes):
                assert not legend.get_window_extent(renderer).shrunk(0.98, 0.98).overlaps(
                    other.get_window_extent(renderer)), f"legend of axes {i} covers axes {j}"
    clashes = [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2)
               if ba.width and bb.width and ba.shrunk(0.95, 0.9).overlaps(bb.shrunk(0.95, 0.9))]
    assert not clashes, clashes


def test_the_page_names_the_injection_once_worded(tmp_path: Path) -> None:
    html, _ = write_report(tmp_path, _points(), _verdicts(), OPTS, [_hit()], [])
    page = Path(html).read_text(encoding="utf-8")
    assert "Injected: rank 3 forward-compute +10% (host) from step 50 until step 90." in page
    none = DemoOptions(inject_rank=None)
    assert describe_injection(none) == "none"
    assert describe_injection(DemoOptions(inject_ms=2.5, inject_kind="device", inject_stage="<x>")) == \
        "rank 3 <x> +2.5 ms per interval (device) from step 50"
