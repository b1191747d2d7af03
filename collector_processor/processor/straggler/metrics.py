"""Prometheus view of the detector, served from the shared registry through a custom collector.

The processor thread mutates plain dicts and, once per request or tick in which a window closed, publishes
an immutable snapshot (a tuple swap: copy-on-write). The scrape thread only reads the latest snapshot, so
neither side takes a lock and nothing is done per span. Series are capped by ``max_series`` (beyond it a
new series is not created and ``evictions{structure="metric_series"}`` counts it) and expire after
``series_ttl_s`` without an update (an alert refreshes its series every window in which it is judged or
held, so only alerts of cohorts that stopped reporting or were evicted expire).

Labels (docs/schema.md "Metrics"): the training job is ``training_job`` (a scrape with ``honor_labels: false``
keeps it as is) and its launch ``run`` (``straggler.run.id``: two runs under one job id are two series), a label
whose value is empty (an unknown host or GPU, no step) is left out of the series, and
an alert's series carry the step where it was first convicted and that step's trace id, so the alert leads to
the trace. The verdict counter and the GPU-seconds-lost counter carry that trace id as an OpenMetrics exemplar.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import otel_straggler_schema as s
from collector_processor.processor.straggler.config import MetricsConfig
from collector_processor.processor.straggler.events import convicted_step
from collector_processor.processor.straggler.model import Verdict
from collector_processor.processor.straggler.window_evidence import WindowOutcome
from collector_processor.telemetry import Telemetry, add_sample
from collector_processor.tenancy import Tenancy

JOB, RUN = s.L_TRAINING_JOB, s.L_RUN
COST_LABELS = (JOB, RUN, "cohort", "rank", "host", "gpu", "stage", "attribution")
ALERT_LABELS = (*COST_LABELS, s.L_FIRST_STEP, s.L_TRACE_ID, s.L_COVERED_BY)
VERDICT_LABELS = (JOB, RUN, "verdict", "reason")
RANK_STAGE_LABELS = (JOB, RUN, "cohort", "rank", "stage_group", "measurement")
RANK_DEV_LABELS = (JOB, RUN, "cohort", "rank")
JOB_LABELS = (JOB, RUN)
COLLECTIVE_LABELS = (JOB, RUN, "cohort", "stage", "ring", "rank")

_Key = tuple[str, ...]
_Snapshot = tuple[
    tuple[tuple[_Key, tuple[float, float, float, float]], ...],
    tuple[tuple[_Key, float], ...],
    tuple[tuple[_Key, float], ...],
    tuple[tuple[_Key, float, str], ...],
    tuple[tuple[_Key, float, str], ...],
    tuple[tuple[_Key, float], ...],
    tuple[tuple[_Key, float], ...],
]
_EMPTY: _Snapshot = ((), (), (), (), (), (), ())
_ALERTS, _RANK_STAGE, _RANK_DEV, _VERDICTS, _COST, _SEEN, _COLLECTIVE = range(7)  # the parts of a snapshot


class StragglerMetrics(Collector):
    def __init__(self, config: MetricsConfig, telemetry: Telemetry, tenancy: Tenancy | None = None) -> None:
        self.cfg = config
        self._evictions = telemetry.evictions.labels(structure="metric_series")
        self.series_refused = 0
        # with tenants, each holds at most its share of max_series, its per-rank series at most 90 % of that
        # share: one tenant's jobs (or runs) cannot take another's series, alerts included
        self._tenancy = tenancy if tenancy else None
        self._tenant_cap = tenancy.share(config.max_series) if tenancy else 0
        self._tenant_series: dict[str, int] = {}  # tenant -> series of its jobs (only tenants holding some)
        self._tenant_refused = telemetry.tenant_evictions
        self._alerts: dict[_Key, list[float]] = {}  # labels -> [active, dev, lost_s, gpu_ratio, t]
        self._alert_keys: dict[_Key, _Key] = {}  # an alert's labels without covered_by -> its series' labels
        self._rank_stage: dict[_Key, list[float]] = {}  # labels -> [seconds, t]
        self._rank_dev: dict[_Key, list[float]] = {}
        self._verdicts: dict[_Key, list[float | str]] = {}  # labels -> [count, exemplar trace id]
        self._cost: dict[_Key, list[float | str]] = {}  # labels -> [GPU-seconds, exemplar trace id]
        self._seen: dict[_Key, list[float]] = {}  # (job, run) -> [last accepted sample's wall time, t]
        self._collective: dict[_Key, list[float]] = {}  # labels -> [seconds lost per step, t]
        self._collective_keys: dict[_Key, _Key] = {}  # a ring's labels without rank -> its series' labels
        self._snapshot: _Snapshot = _EMPTY
        self._dirty: set[int] = set()  # the snapshot's parts (indices of _Snapshot) to rebuild at publish
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
        return (len(self._alerts) + len(self._rank_stage) + len(self._rank_dev) + len(self._verdicts)
                + len(self._cost) + len(self._seen) + len(self._collective))

    def _room(self, job: str, priority: bool = False) -> bool:
        """Room for one more series of ``job`` (the caller adds it when there is). Per-rank dashboard series stop
        at 90 % of ``max_series``: the rest is kept for alert and verdict-count series, so a job with more ranks
        than the cap covers still alerts (with 10 series per rank the default cap holds ~900 ranks' dashboard
        series per process); with tenants, also at the job's tenant's share (its per-rank series at 90 % of it)."""
        limit = self.cfg.max_series if priority else self.cfg.max_series - max(1, self.cfg.max_series // 10)
        if self._series_count() < limit:
            if self._tenancy is None:
                return True
            tenant = self._tenancy(job)
            held = self._tenant_series.get(tenant, 0)
            cap = self._tenant_cap if priority else self._tenant_cap - max(1, self._tenant_cap // 10)
            if held < cap:
                self._tenant_series[tenant] = held + 1
                return True
            self._tenant_refused.labels(tenant=self._tenancy.label(tenant), structure="metric_series").inc()
        self.series_refused += 1
        self._evictions.inc()
        return False

    def _gone(self, job: str) -> None:
        """A series of ``job`` was removed."""
        if self._tenancy is not None:
            tenant = self._tenancy(job)
            held = self._tenant_series.get(tenant, 0) - 1
            if held > 0:
                self._tenant_series[tenant] = held
            else:
                self._tenant_series.pop(tenant, None)

    def _put(self, store: dict[_Key, list[float]], key: _Key, row: list[float],
             priority: bool = False) -> None:
        """Update a series in place, or add it when there is room for it."""
        cur = store.get(key)
        if cur is not None:
            cur[:] = row
        elif self._room(key[0], priority):
            store[key] = row

    def record_window(self, job: str, cohort: str, outcome: WindowOutcome, now_s: float) -> None:
        run = s.cohort_run(cohort)
        for (rank, group, meas), seconds in outcome.rank_group_seconds.items():
            self._put(self._rank_stage, (job, run, cohort, str(rank), group, meas), [seconds, now_s])
        for rank, dev in outcome.rank_deviation.items():
            self._put(self._rank_dev, (job, run, cohort, str(rank)), [dev, now_s])
        self._dirty.update((_RANK_STAGE, _RANK_DEV))
        if outcome.collective_lost:
            for (stage, ring), (lost_ms, named) in outcome.collective_lost.items():
                key = (job, run, cohort, stage, ring, "" if named is None else str(named))
                previous = self._collective_keys.get(key[:5])
                if previous is not None and previous != key and self._collective.pop(previous, None) is not None:
                    self._gone(job)  # the named member changed: one series per ring
                # a ring losing time is a job-level signal (kept with the alerts); one at its baseline a dashboard's
                self._put(self._collective, key, [lost_ms / 1000.0, now_s], priority=lost_ms > 0)
                if key in self._collective:
                    self._collective_keys[key[:5]] = key
            self._dirty.add(_COLLECTIVE)

    def record_seen(self, job: str, now_s: float, run: str = "") -> None:
        """The collector accepted a sample of ``job`` (its run ``run``) at ``now_s`` (its wall clock)."""
        self._put(self._seen, (job, run), [now_s, now_s], priority=True)
        self._dirty.add(_SEEN)

    def record_alert(self, v: Verdict, now_s: float, judged: bool = False, covered_by: str = "") -> None:
        """A straggler alert (new, refreshed or held) or a recovery (active 0) for its series; ``judged``: the
        alert was judged slow in this window, so the window's GPU-seconds lost are added to its cost.
        ``covered_by``: the verdict that explains this one (``L_COVERED_BY``): its series says so, carries no
        cost (the covering verdict's series does) and moves to the new label set when the cover changes.
        A node or group verdict's series names its ranks in ``rank`` (comma-separated)."""
        step, trace = convicted_step(v)
        ranks = v.node_ranks or v.group_ranks
        rank = ",".join(str(r) for r in ranks) if ranks else str(v.rank)
        base = (v.job, s.cohort_run(v.cohort), v.cohort, rank, v.host, v.gpu, v.stage, v.attribution)
        alert = (*base, "" if step is None else str(step), trace.hex())
        key = (*alert, covered_by)
        active = 1.0 if v.verdict == s.VERDICT_STRAGGLER else 0.0
        previous = self._alert_keys.get(alert)
        if previous is not None and not active:
            key = previous  # a recovery ends the series as it was
        elif previous is not None and previous != key and self._alerts.pop(previous, None) is not None:
            self._gone(v.job)  # the cover changed: one series per alert
        paid = active and not covered_by
        lost = v.step_time_lost_ms / 1000.0 if paid else 0.0
        gpu = v.gpu_seconds_per_hour / 3600.0 if paid else 0.0
        dev = v.deviation if v.deviation is not None else 0.0
        self._put(self._alerts, key, [active, dev, lost, gpu, now_s], priority=True)
        if key in self._alerts:
            self._alert_keys[alert] = key
        if judged and paid:
            cur = self._cost.get(base)
            if cur is not None:
                cur[0] = float(cur[0]) + v.window_gpu_seconds
                cur[1] = trace.hex()
            elif self._room(v.job, priority=True):
                self._cost[base] = [v.window_gpu_seconds, trace.hex()]
            self._dirty.add(_COST)
        self._dirty.add(_ALERTS)

    def count_verdicts(self, verdicts: Iterable[Verdict]) -> None:
        for v in verdicts:
            key = (v.job, s.cohort_run(v.cohort), v.verdict, v.reason)
            trace = convicted_step(v)[1].hex()
            cur = self._verdicts.get(key)
            if cur is not None:
                cur[0] = float(cur[0]) + 1
                if trace:  # a verdict without a step (wall-clock window) keeps the last exemplar
                    cur[1] = trace
            elif self._room(v.job, priority=True):
                self._verdicts[key] = [1.0, trace]
            self._dirty.add(_VERDICTS)

    def publish(self, now_s: float) -> None:
        """Expire idle series (a scan of every series: at most once a second, not per request) and swap in a
        new snapshot (only when something changed; only its changed parts are copied: a request that moves
        a job's last-seen time copies that one small part, not every rank's series)."""
        ttl = self.cfg.series_ttl_s
        if now_s >= self._next_expiry_s:
            self._next_expiry_s = now_s + min(1.0, ttl / 10.0)
            for part, d, t_idx in ((_ALERTS, self._alerts, 4), (_RANK_STAGE, self._rank_stage, 1),
                                   (_RANK_DEV, self._rank_dev, 1), (_SEEN, self._seen, 1),
                                   (_COLLECTIVE, self._collective, 1)):
                stale = [k for k, v in d.items() if now_s - v[t_idx] > ttl]
                for k in stale:
                    del d[k]
                    self._gone(k[0])
                    if d is self._alerts:
                        self._alert_keys.pop(k[:-1], None)
                    elif d is self._collective:
                        self._collective_keys.pop(k[:5], None)
                if stale:
                    self._dirty.add(part)
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        snap = list(self._snapshot)
        if _ALERTS in dirty:
            snap[_ALERTS] = tuple((k, (v[0], v[1], v[2], v[3])) for k, v in self._alerts.items())
        if _RANK_STAGE in dirty:
            snap[_RANK_STAGE] = tuple((k, v[0]) for k, v in self._rank_stage.items())
        if _RANK_DEV in dirty:
            snap[_RANK_DEV] = tuple((k, v[0]) for k, v in self._rank_dev.items())
        if _VERDICTS in dirty:
            snap[_VERDICTS] = tuple((k, float(v[0]), str(v[1])) for k, v in self._verdicts.items())
        if _COST in dirty:
            snap[_COST] = tuple((k, float(v[0]), str(v[1])) for k, v in self._cost.items())
        if _SEEN in dirty:
            snap[_SEEN] = tuple((k, v[0]) for k, v in self._seen.items())
        if _COLLECTIVE in dirty:
            snap[_COLLECTIVE] = tuple((k, v[0]) for k, v in self._collective.items())
        self._snapshot = tuple(snap)  # type: ignore[assignment]

    def series(self) -> int:
        return self._series_count()

    # --- scrape thread ------------------------------------------------------------------------------
    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(s.M_STRAGGLER_ACTIVE, "", labels=ALERT_LABELS)
        yield GaugeMetricFamily(s.M_STRAGGLER_DEVIATION, "", labels=ALERT_LABELS)
        yield GaugeMetricFamily(s.M_STEP_TIME_LOST, "", labels=ALERT_LABELS)
        yield GaugeMetricFamily(s.M_GPU_LOST_RATIO, "", labels=ALERT_LABELS)
        yield CounterMetricFamily(s.M_GPU_LOST_SECONDS.removesuffix("_total"), "", labels=COST_LABELS)
        yield CounterMetricFamily(s.M_VERDICTS.removesuffix("_total"), "", labels=VERDICT_LABELS)
        yield GaugeMetricFamily(s.M_RANK_STAGE_SECONDS, "", labels=RANK_STAGE_LABELS)
        yield GaugeMetricFamily(s.M_RANK_DEVIATION, "", labels=RANK_DEV_LABELS)
        yield GaugeMetricFamily(s.M_JOB_LAST_SEEN, "", labels=JOB_LABELS)
        yield GaugeMetricFamily(s.M_COLLECTIVE_LOST, "", labels=COLLECTIVE_LABELS)

    def collect(self) -> Iterator[Metric]:
        alerts, rank_stage, rank_dev, verdicts, cost, seen, collective = self._snapshot  # one read: consistent
        active = GaugeMetricFamily(s.M_STRAGGLER_ACTIVE, "1 while a straggler verdict holds, 0 after recovery")
        dev = GaugeMetricFamily(s.M_STRAGGLER_DEVIATION, "Deviation of the latest judged window")
        lost = GaugeMetricFamily(s.M_STEP_TIME_LOST, "Step time lost per step")
        gpu = GaugeMetricFamily(s.M_GPU_LOST_RATIO, "GPU-seconds the waiting ranks lose per second")
        for labels, (a, d, lo, g) in alerts:
            add_sample(active, ALERT_LABELS, labels, a)
            add_sample(dev, ALERT_LABELS, labels, d)
            add_sample(lost, ALERT_LABELS, labels, lo)
            add_sample(gpu, ALERT_LABELS, labels, g)
        gs = CounterMetricFamily(s.M_GPU_LOST_SECONDS.removesuffix("_total"),
                                 "GPU-seconds the waiting ranks lost while the alert held")
        for labels, n, trace in cost:
            add_sample(gs, COST_LABELS, labels, n, trace)
        vc = CounterMetricFamily(s.M_VERDICTS.removesuffix("_total"), "Verdicts emitted")
        for labels, n, trace in verdicts:
            add_sample(vc, VERDICT_LABELS, labels, n, trace)
        rs = GaugeMetricFamily(s.M_RANK_STAGE_SECONDS, "Last window statistic per rank and stage group")
        for labels, v in rank_stage:
            add_sample(rs, RANK_STAGE_LABELS, labels, v)
        rd = GaugeMetricFamily(s.M_RANK_DEVIATION, "Worst deviation of the rank in its last window")
        for labels, v in rank_dev:
            add_sample(rd, RANK_DEV_LABELS, labels, v)
        js = GaugeMetricFamily(s.M_JOB_LAST_SEEN, "When the collector last accepted a sample of the job")
        for labels, v in seen:
            add_sample(js, JOB_LABELS, labels, v)
        cl = GaugeMetricFamily(s.M_COLLECTIVE_LOST, "Time lost per step in the cohort's collective beyond its baseline")
        for labels, v in collective:
            add_sample(cl, COLLECTIVE_LABELS, labels, v)
        yield from (active, dev, lost, gpu, gs, vc, rs, rd, js, cl)
