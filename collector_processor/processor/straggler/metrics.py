"""Prometheus view of the detector, served from the shared registry through a custom collector.

The processor thread mutates plain dicts and, once per request or tick in which a window closed, publishes
an immutable snapshot (a tuple swap: copy-on-write). The scrape thread only reads the latest snapshot, so
neither side takes a lock and nothing is done per span. Series are capped by ``max_series`` (beyond it a
new series is not created and ``evictions{structure="metric_series"}`` counts it) and expire after
``series_ttl_s`` without an update (an alert refreshes its series every window in which it is judged or
held, so only alerts of cohorts that stopped reporting or were evicted expire).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from collector_processor.processor.straggler.config import MetricsConfig
from collector_processor.processor.straggler.detector import WindowOutcome
from collector_processor.processor.straggler.model import Verdict
from collector_processor.telemetry import Telemetry
from otel_straggler import schema as s

ALERT_LABELS = ("job", "cohort", "rank", "host", "gpu", "stage", "attribution")
VERDICT_LABELS = ("job", "verdict", "reason")
RANK_STAGE_LABELS = ("job", "cohort", "rank", "stage_group", "measurement")
RANK_DEV_LABELS = ("job", "cohort", "rank")

_Snapshot = tuple[
    tuple[tuple[tuple[str, ...], tuple[float, float, float, float]], ...],
    tuple[tuple[tuple[str, ...], float], ...],
    tuple[tuple[tuple[str, ...], float], ...],
    tuple[tuple[tuple[str, ...], float], ...],
]
_EMPTY: _Snapshot = ((), (), (), ())


class StragglerMetrics(Collector):
    def __init__(self, config: MetricsConfig, telemetry: Telemetry) -> None:
        self.cfg = config
        self._evictions = telemetry.evictions.labels(structure="metric_series")
        self.series_refused = 0
        self._alerts: dict[tuple[str, ...], list[float]] = {}  # labels -> [active, dev, lost_s, gpu_s, t]
        self._rank_stage: dict[tuple[str, ...], list[float]] = {}  # labels -> [seconds, t]
        self._rank_dev: dict[tuple[str, ...], list[float]] = {}
        self._verdicts: dict[tuple[str, ...], float] = {}
        self._snapshot: _Snapshot = _EMPTY
        self._dirty = False
        self._next_expiry_s = 0.0
        self.registered = False
        if config.enabled:
            try:
                telemetry.registry.register(self)
                self.registered = True
            except ValueError:  # another processor instance already serves these names on this registry
                self.registered = False

    # --- processor thread ---------------------------------------------------------------------------
    def _series_count(self) -> int:
        return len(self._alerts) + len(self._rank_stage) + len(self._rank_dev) + len(self._verdicts)

    def _room(self, priority: bool = False) -> bool:
        """Room for one more series. Per-rank dashboard series stop at 90 % of ``max_series``: the rest is
        kept for alert and verdict-count series, so a job with more ranks than the cap covers still alerts
        (with 10 series per rank the default cap holds ~900 ranks' dashboard series per process)."""
        limit = self.cfg.max_series if priority else self.cfg.max_series - max(1, self.cfg.max_series // 10)
        if self._series_count() < limit:
            return True
        self.series_refused += 1
        self._evictions.inc()
        return False

    def _put(self, store: dict[tuple[str, ...], list[float]], key: tuple[str, ...], row: list[float],
             priority: bool = False) -> None:
        """Update a series in place, or add it when there is room for it."""
        cur = store.get(key)
        if cur is not None:
            cur[:] = row
        elif self._room(priority):
            store[key] = row

    def record_window(self, job: str, cohort: str, outcome: WindowOutcome, now_s: float) -> None:
        for (rank, group, meas), seconds in outcome.rank_group_seconds.items():
            self._put(self._rank_stage, (job, cohort, str(rank), group, meas), [seconds, now_s])
        for rank, dev in outcome.rank_deviation.items():
            self._put(self._rank_dev, (job, cohort, str(rank)), [dev, now_s])
        self._dirty = True

    def record_alert(self, v: Verdict, now_s: float) -> None:
        """A straggler alert (new or refreshed) or a recovery (active 0) for its series."""
        key = (v.job, v.cohort, str(v.rank), v.host, v.gpu, v.stage, v.attribution)
        active = 1.0 if v.verdict == s.VERDICT_STRAGGLER else 0.0
        lost = v.step_time_lost_ms / 1000.0 if active else 0.0
        gpu = v.gpu_seconds_per_hour if active else 0.0
        dev = v.deviation if v.deviation is not None else 0.0
        self._put(self._alerts, key, [active, dev, lost, gpu, now_s], priority=True)
        self._dirty = True

    def count_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        for v in verdicts:
            key = (v.job, v.verdict, v.reason)
            if key in self._verdicts:
                self._verdicts[key] += 1
            elif self._room(priority=True):
                self._verdicts[key] = 1
            self._dirty = True

    def publish(self, now_s: float) -> None:
        """Expire idle series (a scan of every series: at most once a second, not per request) and swap in a
        new snapshot (only when something changed)."""
        ttl = self.cfg.series_ttl_s
        if now_s >= self._next_expiry_s:
            self._next_expiry_s = now_s + min(1.0, ttl / 10.0)
            for d, t_idx in ((self._alerts, 4), (self._rank_stage, 1), (self._rank_dev, 1)):
                stale = [k for k, v in d.items() if now_s - v[t_idx] > ttl]
                for k in stale:
                    del d[k]
                if stale:
                    self._dirty = True
        if not self._dirty:
            return
        self._snapshot = (
            tuple((k, (v[0], v[1], v[2], v[3])) for k, v in self._alerts.items()),
            tuple((k, v[0]) for k, v in self._rank_stage.items()),
            tuple((k, v[0]) for k, v in self._rank_dev.items()),
            tuple(self._verdicts.items()),
        )
        self._dirty = False

    def series(self) -> int:
        return self._series_count()

    # --- scrape thread ------------------------------------------------------------------------------
    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(s.M_STRAGGLER_ACTIVE, "", labels=ALERT_LABELS)
        yield GaugeMetricFamily(s.M_STRAGGLER_DEVIATION, "", labels=ALERT_LABELS)
        yield GaugeMetricFamily(s.M_STEP_TIME_LOST, "", labels=ALERT_LABELS)
        yield GaugeMetricFamily(s.M_GPU_SECONDS_LOST, "", labels=ALERT_LABELS)
        yield CounterMetricFamily(s.M_VERDICTS.removesuffix("_total"), "", labels=VERDICT_LABELS)
        yield GaugeMetricFamily(s.M_RANK_STAGE_SECONDS, "", labels=RANK_STAGE_LABELS)
        yield GaugeMetricFamily(s.M_RANK_DEVIATION, "", labels=RANK_DEV_LABELS)

    def collect(self) -> Iterator[Metric]:
        alerts, rank_stage, rank_dev, verdicts = self._snapshot  # one reference read: consistent
        active = GaugeMetricFamily(s.M_STRAGGLER_ACTIVE, "1 while a straggler verdict holds, 0 after recovery",
                                   labels=ALERT_LABELS)
        dev = GaugeMetricFamily(s.M_STRAGGLER_DEVIATION, "Deviation of the latest judged window",
                                labels=ALERT_LABELS)
        lost = GaugeMetricFamily(s.M_STEP_TIME_LOST, "Step time lost per step", labels=ALERT_LABELS)
        gpu = GaugeMetricFamily(s.M_GPU_SECONDS_LOST, "GPU-seconds lost per hour", labels=ALERT_LABELS)
        for labels, (a, d, lo, g) in alerts:
            active.add_metric(labels, a)
            dev.add_metric(labels, d)
            lost.add_metric(labels, lo)
            gpu.add_metric(labels, g)
        vc = CounterMetricFamily(s.M_VERDICTS.removesuffix("_total"), "Verdicts emitted", labels=VERDICT_LABELS)
        for labels, n in verdicts:
            vc.add_metric(labels, n)
        rs = GaugeMetricFamily(s.M_RANK_STAGE_SECONDS, "Last window statistic per rank and stage group",
                               labels=RANK_STAGE_LABELS)
        for labels, v in rank_stage:
            rs.add_metric(labels, v)
        rd = GaugeMetricFamily(s.M_RANK_DEVIATION, "Worst deviation of the rank in its last window",
                               labels=RANK_DEV_LABELS)
        for labels, v in rank_dev:
            rd.add_metric(labels, v)
        yield from (active, dev, lost, gpu, vc, rs, rd)
