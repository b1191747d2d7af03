"""The demo's report: one PNG (stage times per rank over steps, deviation heat map, verdict timeline)
and one self-contained HTML page with the summary, the picture and the verdict table."""

from __future__ import annotations

import base64
import html
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_straggler import schema as s

if TYPE_CHECKING:
    from otel_straggler.demo.run import DemoOptions, Detection
    from otel_straggler.demo.tap import StagePoint

_VERDICT_COLOURS = {s.VERDICT_STRAGGLER: "#d62728", s.VERDICT_RECOVERED: "#2ca02c",
                    s.VERDICT_UNCERTAIN: "#bbbbbb"}


def _stage_series(points: list[StagePoint], stage: str) -> dict[int, dict[int, float]]:
    """rank -> step -> ms (device time where present, else host)."""
    series: dict[int, dict[int, float]] = defaultdict(dict)
    for p in points:
        if p.stage != stage:
            continue
        value = p.device_ms if p.device_ms is not None else p.host_ms
        if value is not None:
            series[p.rank][p.step] = float(value)
    return series


def write_report(out: Path, points: list[StagePoint], verdicts: list[dict[str, Any]], opts: DemoOptions,
                 detections: list[Detection]) -> tuple[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage = detections[0].stage if detections else opts.inject_stage
    series = _stage_series(points, stage)
    ranks = sorted(series)
    steps = sorted({st for r in ranks for st in series[r]})
    fig, axes = plt.subplots(3, 1, figsize=(11, 11), gridspec_kw={"height_ratios": [3, 2, 2]})

    ax = axes[0]
    for r in ranks:
        xs = sorted(series[r])
        slow = r == opts.inject_rank
        ax.plot(xs, [series[r][x] for x in xs], lw=2.0 if slow else 0.8, alpha=1.0 if slow else 0.6,
                color="#d62728" if slow else None, label=f"rank {r}" + (" (injected)" if slow else ""))
    if opts.inject_rank is not None:
        ax.axvline(opts.inject_from, color="k", ls="--", lw=0.8)
        ax.text(opts.inject_from, ax.get_ylim()[1], " slowdown starts", va="top", fontsize=8)
        if opts.inject_until:
            ax.axvline(opts.inject_until, color="k", ls=":", lw=0.8)
    ax.set_title(f"'{stage}' time per step, every rank (ms)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.legend(ncol=4, fontsize=7, loc="upper left")

    ax = axes[1]
    grid = []
    for r in ranks:
        row = []
        for st in steps:
            peers = [series[q][st] for q in ranks if q != r and st in series[q]]
            mine = series[r].get(st)
            row.append((mine / statistics.median(peers) - 1.0) * 100 if mine and peers else 0.0)
        grid.append(row)
    if grid and steps:
        im = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-20, vmax=20,
                       extent=(steps[0], steps[-1], len(ranks) - 0.5, -0.5))
        fig.colorbar(im, ax=ax, label="% vs peer median")
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_title(f"'{stage}' deviation from the median of the other ranks, per step")
    ax.set_xlabel("step")
    ax.set_ylabel("rank")

    ax = axes[2]
    for v in verdicts:
        if v.get("step") is None:
            continue
        ax.scatter(int(v["step"]), int(v.get("rank", -1)), s=40, marker="s",
                   color=_VERDICT_COLOURS.get(str(v.get("verdict")), "#888888"))
    for name, colour in _VERDICT_COLOURS.items():
        ax.scatter([], [], color=colour, marker="s", label=name)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(-0.5, max(opts.ranks - 0.5, 0.5))
    ax.set_yticks(range(opts.ranks))
    ax.set_xlim(0, opts.steps + 1)
    ax.set_title("verdict timeline (step at which each verdict fired, by rank)")
    ax.set_xlabel("step")
    ax.set_ylabel("rank")
    fig.tight_layout()
    png = out / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)

    rows = "".join(
        f"<tr><td>{d.rank}</td><td>{html.escape(d.stage)}</td><td>{d.verdict}</td>"
        f"<td>{(d.deviation or 0):+.1%}</td><td>{d.step}</td><td>{d.steps_to_detect}</td>"
        f"<td>{html.escape(d.attribution)}</td><td>{(d.step_time_lost_ms or 0):.1f}</td>"
        f"<td>{(d.gpu_seconds_per_hour or 0):.0f}</td><td>{d.recovered_step or ''}</td></tr>"
        for d in detections)
    vrows = "".join(
        f"<tr><td>{v.get('step')}</td><td>{v.get('rank')}</td><td>{html.escape(str(v.get('stage')))}</td>"
        f"<td>{v.get('verdict')}</td><td>{html.escape(str(v.get('reason')))}</td>"
        f"<td>{float(v.get('deviation') or 0):+.1%}</td><td>{html.escape(str(v.get('attribution')))}</td></tr>"
        for v in verdicts[:500])
    img = base64.b64encode(png.read_bytes()).decode()
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>otel-straggler demo</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}th{{background:#f4f4f4}}</style></head><body>
<h1>otel-straggler demo: {opts.ranks} ranks, {opts.steps} steps</h1>
<p>Injected: rank {opts.inject_rank}, stage <code>{html.escape(opts.inject_stage)}</code>,
+{opts.inject_slowdown:.0%} ({opts.inject_kind}) from step {opts.inject_from}.</p>
<h2>Detections</h2><table><tr><th>rank</th><th>stage</th><th>verdict</th><th>deviation</th><th>step</th>
<th>steps to detect</th><th>attribution</th><th>ms lost/step</th><th>GPU-s/h</th><th>recovered at</th></tr>
{rows}</table>
<p>False alarms (straggler verdicts on ranks that were not slowed): {sum(d.rank != opts.inject_rank
                                                                       for d in detections)}</p>
<img src="data:image/png;base64,{img}" style="max-width:100%">
<h2>All verdicts</h2><table><tr><th>step</th><th>rank</th><th>stage</th><th>verdict</th><th>reason</th>
<th>deviation</th><th>attribution</th></tr>{vrows}</table></body></html>"""
    page_path = out / "report.html"
    page_path.write_text(page, encoding="utf-8")
    return str(page_path), str(png)
