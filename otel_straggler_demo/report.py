"""The demo's report: one PNG (stage times per rank over steps, deviation heat map, verdict timeline) and one
self-contained HTML page with the outcome banner, the picture, and the verdicts with their reasons in plain
words.

The heat map compares what the detector compares: each rank's median over a window of steps against the
fastest other rank's (the detector's reference peer; in a cohort of more than 10 peers the one at its
``fastest_quantile``), so a cell is the deviation a verdict of that window reports.
"""

from __future__ import annotations

import base64
import html
import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import otel_straggler_schema as s
from otel_straggler.export.probe import redact
from otel_straggler_demo.options import DemoOptions, Detection, describe_injection, detector_settings, injecting
from otel_straggler_demo.outcome import explain, series_window_deviations, stage_series
from otel_straggler_demo.tap import StagePoint

if TYPE_CHECKING:
    from collector_processor.processor.straggler.config import Config

_VERDICT_STYLE = {s.VERDICT_STRAGGLER: ("#d62728", "s", 60), s.VERDICT_RECOVERED: ("#2ca02c", "^", 60),
                  s.VERDICT_UNCERTAIN: ("#999999", ".", 30)}


def window_deviation_grid(series: dict[int, dict[int, float]], window_steps: int, *, fastest_quantile: float
                          ) -> tuple[list[int], list[int], list[list[float]]]:
    """(ranks, window indices, grid[rank][window]) of ``series_window_deviations``, the detector's comparison
    (NaN where the rank or its peers have no sample)."""
    devs = series_window_deviations(series, window_steps, fastest_quantile=fastest_quantile)
    ranks = sorted(series)
    windows = sorted({step // window_steps for by_step in series.values() for step in by_step})
    return ranks, windows, [[devs.get(r, {}).get(w, float("nan")) for w in windows] for r in ranks]


def robust_limits(values: list[float]) -> tuple[float, float]:
    """y-axis limits holding the bulk of the values: the 1st to 99th percentile, padded; spikes (warm-up,
    a descheduled step) fall outside and are counted on the plot instead of flattening it."""
    if not values:
        return 0.0, 1.0
    ordered = sorted(values)
    lo = ordered[int(0.01 * (len(ordered) - 1))]
    hi = ordered[int(0.99 * (len(ordered) - 1))]
    pad = max(hi - lo, 0.05 * max(abs(hi), 1e-9))
    return max(0.0, lo - 0.5 * pad), hi + 0.5 * pad


def outcome_line(opts: DemoOptions, detections: list[Detection], problems: list[str], external: bool) -> str:
    """One sentence: what the run found (the banner of the page and the picture)."""
    if external:
        return (f"Spans went to the external collector {redact(opts.endpoint)}: its evidence, metrics and events "
                "hold the verdicts.")
    hits = [d for d in detections if d.injected]
    if problems:
        return "FAILED: " + "; ".join(problems)
    if hits:
        d = hits[0]
        return (f"Found: rank {d.rank} {d.stage} {(d.deviation or 0):+.1%} at step {d.step}, {d.steps_to_detect} "
                f"steps after its slowdown began ({d.attribution}); no false alarms.")
    return "No straggler injected, none detected."


def write_report(out: Path, points: list[StagePoint], verdicts: list[dict[str, Any]], opts: DemoOptions,
                 detections: list[Detection], problems: list[str] | None = None, *, det: Config | None = None,
                 external: bool = False) -> tuple[str, str]:
    """report.png and report.html in ``out``; returns their paths. ``det``: the detector's settings (default:
    those of the collector the demo starts for ``opts.ranks``)."""
    import matplotlib.pyplot as plt

    det = det or detector_settings(opts.ranks)
    window_steps = det.window_steps
    problems = problems or []
    banner = outcome_line(opts, detections, problems, external)
    fig = build_figure(points, verdicts, opts, detections, banner, failed=bool(problems), det=det)
    png = out / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    page_path = out / "report.html"
    page_path.write_text(_page(opts, detections, verdicts, problems, banner, png, window_steps), encoding="utf-8")
    return str(page_path), str(png)


def build_figure(points: list[StagePoint], verdicts: list[dict[str, Any]], opts: DemoOptions,
                 detections: list[Detection], banner: str, *, failed: bool, det: Config | None = None) -> Any:
    """The report's picture (a matplotlib Figure): the stage's time per rank and step, the detector's view
    of it per window, and the verdict timeline. ``det`` as in ``write_report``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    det = det or detector_settings(opts.ranks)
    window_steps = det.window_steps
    stage = opts.inject_stage if injecting(opts) else (detections[0].stage if detections else opts.inject_stage)
    series = stage_series(points, stage)
    ranks = sorted(series)
    slow = opts.inject_rank if injecting(opts) else None
    fig, axes = plt.subplots(3, 1, figsize=(12, 12), gridspec_kw={"height_ratios": [3, 2, 2]},
                             layout="constrained")
    fig.suptitle(banner if len(banner) < 140 else banner[:137] + "...", fontsize=10,
                 color="#d62728" if failed else "#2ca02c")

    # 1. the stage's time per step, every rank; the y-axis holds the bulk, spikes are counted
    ax = axes[0]
    warm = 2 * window_steps  # the detector's warm-up windows
    bulk = [v for r in ranks for st, v in series[r].items() if st >= warm] or \
        [v for r in ranks for v in series[r].values()]
    lo, hi = robust_limits(bulk)
    clipped = 0
    for r in ranks:
        xs = sorted(series[r])
        ys = [series[r][x] for x in xs]
        clipped += sum(1 for y in ys if y > hi or y < lo)
        is_slow = r == slow
        ax.plot(xs, ys, lw=2.0 if is_slow else 0.8, alpha=1.0 if is_slow else 0.7,
                color="#d62728" if is_slow else None, label=f"rank {r}" + (" (slowed)" if is_slow else ""),
                zorder=3 if is_slow else 2)
    if slow is not None:
        ax.axvline(opts.inject_from, color="k", ls="--", lw=0.8, label=f"slowdown from step {opts.inject_from}")
        if opts.inject_until:
            ax.axvline(opts.inject_until, color="k", ls=":", lw=0.8, label=f"back at par at step {opts.inject_until}")
    ax.set_ylim(lo, hi)
    ax.set_xlim(0, opts.steps + 1)
    ax.set_title(f"'{stage}' time per step, every rank (ms)"
                 + (f"; {clipped} points outside the axis (warm-up, spikes)" if clipped else ""), fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)

    # 2. what the detector compares: window medians against the fastest other rank
    ax = axes[1]
    g_ranks, windows, grid = window_deviation_grid(series, window_steps,
                                                    fastest_quantile=det.fastest_quantile)
    finite = [abs(v) for row in grid for v in row if not math.isnan(v)]
    vmax = max(0.05, 1.5 * opts.inject_slowdown if slow is not None else 0.0,
               sorted(finite)[int(0.98 * (len(finite) - 1))] if finite else 0.0)
    vmax = min(vmax, 1.0)
    if grid and windows:
        im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest",
                       extent=(windows[0] * window_steps, (windows[-1] + 1) * window_steps,
                               len(g_ranks) - 0.5, -0.5))
        fig.colorbar(im, ax=ax, label="vs fastest other rank", format=lambda x, _pos: f"{x:+.0%}")
    ax.set_xlim(0, opts.steps + 1)
    ax.set_yticks(range(len(g_ranks)), [str(r) for r in g_ranks])
    ax.set_title(f"'{stage}': each rank's {window_steps}-step median against the fastest other rank's "
                 "(the detector's reference), per window", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("rank")

    # 3. verdict timeline: one marker per (step, rank, verdict), whatever the stage
    ax = axes[2]
    marks: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for v in verdicts:
        if v.get("step") is not None:
            marks[str(v.get("verdict"))].add((int(v["step"]), int(v.get("rank", -1))))
    for name, (colour, marker, size) in _VERDICT_STYLE.items():
        pts = sorted(marks.get(name, ()))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=size, marker=marker, color=colour,
                   label=f"{name} ({len(pts)})", zorder=3 if name != s.VERDICT_UNCERTAIN else 2)
    if slow is not None:
        ax.axvline(opts.inject_from, color="k", ls="--", lw=0.8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_ylim(-0.5, max(opts.ranks - 0.5, 0.5))
    ax.set_yticks(range(opts.ranks))
    ax.set_xlim(0, opts.steps + 1)
    ax.set_title("verdicts by rank and the step where they fired (any stage; reasons in the table)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    return fig


def _page(opts: DemoOptions, detections: list[Detection], verdicts: list[dict[str, Any]], problems: list[str],
          banner: str, png: Path, window_steps: int) -> str:
    esc = html.escape
    rows = "".join(
        f"<tr><td>{d.rank}</td><td>{esc(d.stage)}</td><td>{'slowed' if d.injected else 'false alarm'}"
        f"</td><td>{(d.deviation or 0):+.1%}</td><td>{d.reference_rank if d.reference_rank is not None else ''}"
        f"</td><td>{d.step}</td><td>{d.steps_to_detect if d.steps_to_detect is not None else ''}</td>"
        f"<td>{esc(d.attribution)}</td><td>{(d.step_time_lost_ms or 0):.1f}</td>"
        f"<td>{(d.gpu_seconds_per_hour or 0):.0f}</td><td>{d.recovered_step or ''}</td></tr>"
        for d in detections)
    shown = verdicts[:500]
    vrows = "".join(
        f"<tr><td>{v.get('step')}</td><td>{v.get('rank')}</td><td>{esc(str(v.get('stage')))}</td>"
        f"<td>{v.get('verdict')}</td><td>{esc(str(v.get('reason')))}</td>"
        f"<td>{float(v.get('deviation') or 0):+.1%}</td><td>{v.get('reference_rank', '')}</td>"
        f"<td>{esc(str(v.get('attribution')))}</td><td>{esc(explain(str(v.get('reason'))))}</td></tr>"
        for v in shown)
    more = f"<p>First {len(shown)} of {len(verdicts)} verdicts.</p>" if len(verdicts) > len(shown) else ""
    reasons = sorted({str(v.get("reason")) for v in verdicts})
    legend = "".join(f"<li><code>{esc(r)}</code>: {esc(explain(r))}</li>" for r in reasons)
    colour = "#fde2e2" if problems else "#e3f5e1"
    why = "".join(f"<li>{esc(p)}</li>" for p in problems)
    img = base64.b64encode(png.read_bytes()).decode()
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>otel-straggler demo</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1150px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}th{{background:#f4f4f4}}
.banner{{background:{colour};padding:0.8em 1em;border-radius:4px;font-size:15px}}</style></head><body>
<h1>otel-straggler demo: {opts.ranks} ranks, {opts.steps} steps ({esc(opts.model)})</h1>
<div class="banner"><b>{esc(banner)}</b>{f"<ul>{why}</ul>" if why else ""}</div>
<p>Injected: {esc(describe_injection(opts))}.</p>
<h2>Detections</h2><table><tr><th>rank</th><th>stage</th><th>rank was</th><th>deviation</th><th>vs rank</th>
<th>step</th><th>steps to detect</th><th>attribution</th><th>ms lost/step</th><th>GPU-s/h</th><th>recovered at</th>
</tr>{rows}</table>
<p>Deviation is the rank's statistic against its reference peer, the fastest comparable rank, as in the heat map
(window medians of {window_steps} steps); a verdict convicted by summed per-step evidence
(<code>persistent_excess</code>) compares against the peers' per-step median instead and names no rank.</p>
<img src="data:image/png;base64,{img}" style="max-width:100%">
<h2>What the reasons mean</h2><ul>{legend}</ul>
<h2>All verdicts</h2>{more}<table><tr><th>step</th><th>rank</th><th>stage</th><th>verdict</th><th>reason</th>
<th>deviation</th><th>vs rank</th><th>attribution</th><th>meaning</th></tr>{vrows}</table></body></html>"""
