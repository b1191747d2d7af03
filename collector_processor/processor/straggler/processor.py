"""The straggler processor: OTLP traces in, verdicts out (events, verdict spans, metrics, evidence).

Single-threaded by contract (the service serialises calls on one instance); only the metrics snapshot is
read from another thread, through an immutable swap (see ``metrics.py``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import otel_straggler_schema as s
from collector_processor.processor.straggler.cohort import NO_CEILING, NO_INDEX, Cohort, CohortRegistry, RankInfo
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.culprit import Correlator
from collector_processor.processor.straggler.decode import (
    REJECT_DUPLICATE,
    REJECT_LATE,
    REJECT_MALFORMED,
    REJECT_OVER_CAP,
    REJECT_QUARANTINED,
    decode_request,
)
from collector_processor.processor.straggler.detector import Detector
from collector_processor.processor.straggler.events import verdict_resource_spans
from collector_processor.processor.straggler.metrics import StragglerMetrics
from collector_processor.processor.straggler.model import StageSample, StepSummary, Verdict
from collector_processor.processor.straggler.node import NodeVerdicts
from collector_processor.processor.straggler.rejections import RERUN_BEHIND_WINDOWS, RejectionLog
from collector_processor.processor.straggler.state import StateStore
from collector_processor.processor.straggler.window import (
    KIND_STEP,
    Window,
    WindowSet,
    due_by_age,
    due_by_progress,
    due_by_time,
)
from collector_processor.telemetry import Telemetry
from collector_processor.tenancy import Tenancy

log = logging.getLogger(__name__)

_MAX_PENDING_SPANS = 4096
# A cohort's range of steps (step quarantine) is recomputed at most this often: a sort of its ranks' latest windows
RANGE_REFRESH_S = 1.0
COUNTERS = (
    "spans_accepted", "rejected_malformed", "rejected_non_finite", "rejected_duplicate", "rejected_late",
    "rejected_over_cap", "rejected_quarantined", "windows_quarantined", "fences_rolled_back",
    "non_finite_values", "windows_closed", "windows_closed_early", "windows_closed_by_grace",
    "windows_closed_by_age",
    "warmup_excluded", "missing_windows", "non_finite_windows", "device_samples_missing_windows",
    "progress_close_deferred",
    "workload_incomparable_windows",
    "below_min_cohort_windows", "below_floor_windows", "recovery_withheld_windows", "uncertain_suppressed",
    "pair_ambiguous_windows", "collective_wait_windows", "mp_wait_windows",
    "host_contention_windows", "intermittent_verdicts",
    "verdicts_straggler", "verdicts_recovered", "verdicts_uncertain", "emit_failures",
    "evicted_cohorts", "evicted_windows", "evicted_ranks", "evicted_stages", "evicted_dedup",
    "evicted_states", "verdict_spans_dropped",
)

# evictions_total{structure} values this processor counts (metric_series: StragglerMetrics)
EVICTED_STRUCTURES = ("cohorts", "windows", "dedup", "cohort_ranks", "stages", "open_windows", "detector_states",
                      "quarantined_windows")


class StragglerProcessor:
    def __init__(self, config: Config, telemetry: Telemetry, emit_verdicts: Callable[[list[Verdict]], None],
                 *, clock: Callable[[], float] = time.time, wall_clock_ns: Callable[[], int] = time.time_ns,
                 tenant_of: Callable[[str], str] | None = None) -> None:
        self.cfg = config
        self.telemetry = telemetry
        self._emit = emit_verdicts
        self._clock = clock
        self._wall_ns = wall_clock_ns
        self.c: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.cohorts = CohortRegistry(config.max_cohorts, tenant_of, telemetry.tenant_evictions)
        self.states = StateStore(config.max_states)
        self.detector = Detector(config, self.states, self.c, self.cohorts)
        self.nodes = NodeVerdicts(config, self.c)
        self.culprits = Correlator(config, self.c, self.cohorts)
        tenancy = tenant_of if isinstance(tenant_of, Tenancy) else None
        self.metrics = StragglerMetrics(config.metrics, telemetry, tenancy)
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._pending: list[Verdict] = []
        self._pending_spans: list[Verdict] = []
        # (alert or recovery, judged in its window) since the last _finish: recorded with their cover there
        self._pending_alerts: list[tuple[Verdict, bool]] = []
        self._wall_window_ns = round(config.wall_window_s * 1e9)
        self._evict_flush: dict[str, int] = {}
        self._closed_flush = 0
        self.last_rejected = 0
        for structure in EVICTED_STRUCTURES:  # at 0 from the start
            telemetry.evictions.labels(structure=structure)
        self._said = RejectionLog(config, self.c, log)  # duplicate and late rejections, said once

    # --- component ----------------------------------------------------------------------------------
    def start(self) -> None:
        return

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Close (judge) every open window and emit the verdicts; bounded by ``timeout_s``."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        now = self._clock()
        for cohort in self.cohorts:
            if time.monotonic() > deadline:
                break
            cohort.range_at = float("-inf")
            self._refresh_range(cohort, now)
            for ws in (cohort.steps, cohort.wall):
                if ws.open:
                    self._close(cohort, ws, max(ws.open), now)
        self._finish(now)

    # --- data path ----------------------------------------------------------------------------------
    def process_traces(self, req: ExportTraceServiceRequest) -> ExportTraceServiceRequest | None:
        now = self._clock()
        res = decode_request(req.resource_spans, self.cfg.collector_service_name)
        rejected = res.rejected
        self.c["non_finite_values"] += res.non_finite_values
        touched: dict[int, Cohort] = {}
        accepted = self._take_samples(res.samples, rejected, touched, now)
        accepted += self._take_summaries(res.summaries, rejected, touched, now)
        seen = None
        for cohort in touched.values():
            if self.metrics.registered and cohort.job != seen:
                seen = cohort.job
                self.metrics.record_seen(cohort.job, now, s.cohort_run(cohort.key))
            self._close_by_progress(cohort, now)
        self._count_request(req, accepted, rejected)
        self._said.rate_late(now, len(res.samples) + len(res.summaries), rejected.get(REJECT_LATE, 0), self.cohorts)
        self._finish(now)
        if self._pending_spans and self.cfg.emit_verdict_spans:
            rs = verdict_resource_spans(self._pending_spans, self.cfg.collector_service_name)
            self._pending_spans = []
            if rs is not None:
                req.resource_spans.append(rs)
        return req

    def _take_samples(self, samples: list[StageSample], rejected: dict[str, int], touched: dict[int, Cohort],
                      now: float) -> int:
        """Stage-span samples into their windows (consecutive samples of one cohort look it up once); the samples
        accepted, the rejected counted by reason, the cohorts that took one in ``touched``."""
        accepted = 0
        last_key: tuple[str, str] | None = None
        cohort: Cohort | None = None
        for smp in samples:
            if smp.device_ms is None and smp.host_ms is None:
                # already rejected as non_finite by the decoder; the window still learns of it
                cohort = self._cohort(smp, now) if (smp.job, smp.cohort) != last_key else cohort
                last_key = (smp.job, smp.cohort)
                if cohort is not None:
                    self._add(cohort, smp, now, non_finite=True)
                continue
            if self._duplicate(smp.span_id):
                rejected[REJECT_DUPLICATE] = rejected.get(REJECT_DUPLICATE, 0) + 1
                continue
            if (smp.job, smp.cohort) != last_key:
                cohort = self._cohort(smp, now)
                last_key = (smp.job, smp.cohort)
            if cohort is None:
                continue
            outcome = self._add(cohort, smp, now)
            if outcome is None:
                accepted += 1
                touched[id(cohort)] = cohort
            elif outcome == REJECT_LATE or outcome == REJECT_OVER_CAP or outcome == REJECT_QUARANTINED:
                rejected[outcome] = rejected.get(outcome, 0) + 1
        return accepted

    def _take_summaries(self, summaries: list[StepSummary], rejected: dict[str, int], touched: dict[int, Cohort],
                        now: float) -> int:
        """Step summaries into their windows, as ``_take_samples``. Rejections count spans (one rank-step span),
        as partial_success reports them; acceptances count the samples the detector uses."""
        accepted = 0
        last_key: tuple[str, str] | None = None
        cohort: Cohort | None = None
        for summ in summaries:
            if (summ.job, summ.cohort) != last_key:
                cohort = self._cohort(summ, now)
                last_key = (summ.job, summ.cohort)
            if cohort is None:
                continue
            ok = self._add_summary(cohort, summ, now)
            if isinstance(ok, str):
                rejected[ok] = rejected.get(ok, 0) + 1
                if ok == REJECT_DUPLICATE:
                    self._said.duplicate(summ, now)
            elif ok:
                accepted += ok
                touched[id(cohort)] = cohort
        return accepted

    def _count_request(self, req: ExportTraceServiceRequest, accepted: int, rejected: dict[str, int]) -> None:
        """Telemetry, once per request: the spans accepted and rejected (``last_rejected``: the request's rejected
        spans, as partial_success reports them)."""
        c = self.c
        c["spans_accepted"] += accepted
        if accepted:
            self.telemetry.spans_accepted.inc(accepted)
        total_rejected = 0
        for reason, n in rejected.items():
            c["rejected_" + reason] = c.get("rejected_" + reason, 0) + n
            self.telemetry.spans_rejected.labels(reason=reason).inc(n)
            total_rejected += n
        if total_rejected:
            # summary entries are rejected one by one (malformed/non_finite), but partial_success reports spans
            total_rejected = min(total_rejected, sum(len(ss.spans) for rs in req.resource_spans
                                                     for ss in rs.scope_spans))
        self.last_rejected = total_rejected

    def tick(self, now_s: float) -> None:
        """Close windows whose grace expired, wall-clock windows past their span, windows held open only by
        ranks that stopped reporting (``rank_timeout_s``), and windows idle or old beyond ``window_idle_s`` /
        ``window_max_age_s`` (an idle collector closes its last windows here)."""
        cfg = self.cfg
        for cohort in self.cohorts:
            self._refresh_range(cohort, now_s)
            for ws in (cohort.steps, cohort.wall):
                if not ws.open:
                    continue
                due = due_by_time(ws, now_s, ws.grace(cfg.grace_s, cfg.grace_max_s), cfg.wall_window_s)
                if due is not None:
                    self.c["windows_closed_by_grace"] += sum(1 for i in ws.open if i <= due)
                    self._close(cohort, ws, due, now_s)
                due = due_by_age(ws, now_s, cfg.window_idle_s, cfg.window_max_age_s)
                if due is not None:
                    self.c["windows_closed_by_age"] += sum(1 for i in ws.open if i <= due)
                    self._close(cohort, ws, due, now_s)
            self._close_by_progress(cohort, now_s)
        self._finish(now_s)

    # --- queries ------------------------------------------------------------------------------------
    def active(self) -> list[Verdict]:
        return self.states.active_alerts()

    def stats(self) -> dict[str, int]:
        out = dict(self.c)
        out["cohorts"] = len(self.cohorts)
        out["open_windows"] = sum(len(ch.steps.open) + len(ch.wall.open) for ch in self.cohorts)
        out["window_samples"] = sum(w.held() for ch in self.cohorts for ws in (ch.steps, ch.wall)
                                    for w in ws.open.values())
        out["states"] = len(self.states)
        out["active"] = len(self.states.active_alerts())
        out["dedup_entries"] = len(self._seen)
        out["metric_series"] = self.metrics.series()
        out["metric_series_refused"] = self.metrics.series_refused
        out["evicted_states"] = self.states.evicted
        out["metrics_registered"] = int(self.metrics.registered)
        return out

    # --- internals ----------------------------------------------------------------------------------
    def _evicted(self, structure: str, n: int = 1) -> None:
        self._evict_flush[structure] = self._evict_flush.get(structure, 0) + n

    def _cohort(self, smp: StageSample | StepSummary, now: float) -> Cohort:
        cohort, evicted = self.cohorts.get(smp.job, smp.cohort, now)
        if evicted is not None:
            self.c["evicted_cohorts"] += 1
            self._evicted("cohorts")
            dropped = len(evicted.steps.open) + len(evicted.wall.open)
            if dropped:
                self.c["evicted_windows"] += dropped
                self._evicted("windows", dropped)
            self.states.drop_cohort(evicted.job, evicted.key)
        return cohort

    def _add(self, cohort: Cohort, smp: StageSample, now: float, non_finite: bool = False) -> str | None:
        """Put one sample in its window. None when accepted, else why not."""
        info = self._rank(cohort, smp.rank, smp.host, smp.gpu, smp.world_size, smp.dp_size, now, smp.dp_rank)
        if info is None or not self._stage_ok(cohort, smp.stage, smp.group):
            return "capped"
        w = self._window(cohort, info, smp.step, smp.start_unix_ns, now)
        if isinstance(w, str):
            return w
        if non_finite:
            w.cell(smp.stage, smp.rank)  # a non-finite sample still makes the rank present in the window
            return None
        if not w.add_sample(smp.stage, smp.rank, smp.step, smp.device_ms, smp.host_ms, smp.tokens,
                            self.cfg.max_samples_per_step):
            return REJECT_OVER_CAP
        if smp.collective:
            cohort.collective.add(smp.stage)
        w.took(smp.step, smp.start_unix_ns, smp.end_unix_ns, now)
        return None

    def _add_summary(self, cohort: Cohort, summ: StepSummary, now: float) -> int | str:
        """Every entry of one rank-step summary, as ``_add`` would put them one by one (one rank, one step,
        so one window: looked up once). Returns the samples accepted, or why none: ``late`` (the window is
        closed), ``duplicate`` (the window holds this rank's summary of this step: a summary is one per rank
        and step, whatever its span id), ``malformed`` (a stage listed twice). The summary is queued in its
        window as a whole (``Window.queue_summary``); its entries' stages are admitted once per rank and
        window, not per rank-step."""
        stages = summ.stages
        if not stages:
            return 0
        info = self._rank(cohort, summ.rank, summ.host, summ.gpu, summ.world_size, summ.dp_size, now, summ.dp_rank)
        if info is not None and summ.gpu_hints is not None:
            info.gpu_hints = summ.gpu_hints
        if info is None:
            return 0
        w = self._window(cohort, info, summ.step, summ.start_unix_ns, now)
        if isinstance(w, str):
            return w
        devs = summ.device_ms
        hosts = summ.host_ms
        new_stages = w.queued(summ.rank) != stages
        if new_stages and len(set(stages)) != len(stages):
            return REJECT_MALFORMED
        if not w.first_summary(summ.rank, summ.step):
            return REJECT_DUPLICATE
        if new_stages:  # (the cohort's stages only grow: admitted once, admitted for good)
            groups = summ.groups
            admitted = [self._stage_ok(cohort, stage, groups[i]) for i, stage in enumerate(stages)]
            if not all(admitted):  # over max_stages: the admitted entries one by one
                n = w.add_entries(summ.rank, summ.step, summ.tokens, stages, devs, hosts, admitted)
                if n:
                    w.took(summ.step, summ.start_unix_ns, summ.end_unix_ns, now)
                return n
        if summ.collective:  # stages marked collective (admitted ones: bounded by max_stages)
            cohort.collective.update(n for n in summ.collective if n in cohort.stages)
        w.queue_summary(summ.rank, stages, summ.step, summ.tokens, devs, hosts)
        # an entry with neither value (non-finite, already counted by the decoder) is present, not accepted
        accepted = len(stages) if None not in hosts else sum(
            1 for dev, host in zip(devs, hosts, strict=True) if dev is not None or host is not None)
        if accepted:
            w.took(summ.step, summ.start_unix_ns, summ.end_unix_ns, now)
        return accepted

    def _duplicate(self, span_id: bytes) -> bool:
        """True when this stage span's id was seen (LRU set of ``dedup_capacity``); an empty id is never a
        duplicate."""
        if not span_id:
            return False
        seen = self._seen
        if span_id in seen:
            return True
        seen[span_id] = None
        if len(seen) > self.cfg.dedup_capacity:
            seen.popitem(last=False)
            self.c["evicted_dedup"] += 1
            self._evicted("dedup")
        return False

    def _rank(self, cohort: Cohort, rank: int, host: str, gpu: str, world_size: int, dp_size: int,
              now: float, dp_rank: int = -1) -> RankInfo | None:
        """The rank's entry in its cohort (created, within the cap), marked seen now; None when capped."""
        info = cohort.ranks.get(rank)
        if info is None:
            cfg = self.cfg
            if len(cohort.ranks) >= cfg.max_ranks_per_cohort:
                self.c["evicted_ranks"] += 1
                self._evicted("cohort_ranks")
                return None
            info = cohort.ranks[rank] = RankInfo(host, gpu, world_size, now, dp_rank=dp_rank)
            if dp_size > cohort.expected_ranks:
                cohort.expected_ranks = min(dp_size, cfg.max_ranks_per_cohort)
        else:
            info.last_seen_s = now
        return info

    def _stage_ok(self, cohort: Cohort, stage: str, group: str) -> bool:
        if stage not in cohort.stages:
            if len(cohort.stages) >= self.cfg.max_stages:
                self.c["evicted_stages"] += 1
                self._evicted("stages")
                return False
            cohort.stages[stage] = group
        return True

    def _window(self, cohort: Cohort, info: RankInfo, step: int | None, start_unix_ns: int,
                now: float) -> Window | str:
        """The open window a sample of ``step`` (or, without a step, of its start time) belongs to, opened
        if needed (closing the oldest beyond ``max_open_windows``); else why not: ``late`` (it is already
        closed) or ``quarantined`` (far beyond the cohort's range of steps: ``_refresh_range``)."""
        cfg = self.cfg
        if step is not None:
            ws = cohort.steps
            idx = step // cfg.window_steps
            info.claim_index = idx
            if idx > cohort.step_ceiling:
                return REJECT_QUARANTINED
            info.in_range = True
            if idx > info.max_step_index:
                info.max_step_index = idx
        else:
            ws = cohort.wall
            if ws.anchor_ns is None:
                ws.anchor_ns = start_unix_ns
            idx = (start_unix_ns - ws.anchor_ns) // self._wall_window_ns
            if idx > info.max_wall_index:
                info.max_wall_index = idx
        if ws.fenced(idx, now):
            if step is not None and info.max_step_index - idx > RERUN_BEHIND_WINDOWS:
                self._said.far_late(cohort.job)  # behind the rank's own progress: its steps started again
            return REJECT_LATE
        w = ws.open.get(idx)
        if w is None:
            oldest = ws.full(cfg.max_open_windows)
            if oldest is not None:
                if idx < oldest:
                    return REJECT_LATE
                self.c["windows_closed_early"] += 1
                self._evicted("open_windows")
                self._close(cohort, ws, oldest, now)
            w = ws.get_or_open(idx, now, cfg.window_steps)
        return w

    def _refresh_range(self, cohort: Cohort, now: float) -> None:
        """Step quarantine: the cohort's range of steps is the lower median of its ranks' latest step windows
        (each rank's latest sample, quarantined or not), over the ranks that have had a sample not quarantined
        and were heard from within ``rank_timeout_s`` (every such rank when none was). A sample more than
        ``step_quarantine_windows`` windows beyond it is rejected as ``quarantined`` until then; windows beyond
        it that opened before the range was known are dropped unjudged (counted), and a fence they moved comes
        back to the range, so they can neither close the cohort's windows nor make its samples late for longer
        than a tick. One rank (or any number of new ranks whose samples were all quarantined) cannot move the
        range: a wrong step number, or a client writing far-future steps into a job, makes no real sample
        late; a whole cohort that jumps moves it at the next tick."""
        q = self.cfg.step_quarantine_windows
        if q <= 0 or now - cohort.range_at < RANGE_REFRESH_S:
            return
        cohort.range_at = now
        timeout = self.cfg.rank_timeout_s
        with_data = [r for r in cohort.ranks.values() if r.in_range]
        claims = [r.claim_index for r in with_data if now - r.last_seen_s <= timeout] or \
            [r.claim_index for r in with_data]
        if not claims:
            cohort.step_ceiling = NO_CEILING
            return
        claims.sort()
        ceiling = cohort.step_ceiling = claims[(len(claims) - 1) // 2] + q
        ws = cohort.steps
        far = ws.drop_beyond(ceiling)
        if far:
            self.c["windows_quarantined"] += far
            self._evicted("quarantined_windows", far)
            for r in cohort.ranks.values():
                if r.max_step_index > ceiling:
                    r.max_step_index = ceiling
        if ws.fence_back(ceiling):  # moved by windows beyond the range
            self.c["fences_rolled_back"] += 1

    def _close_by_progress(self, cohort: Cohort, now: float) -> None:
        timeout = self.cfg.rank_timeout_s
        for ws in (cohort.steps, cohort.wall):
            if not ws.open:
                continue
            step_kind = ws.kind == KIND_STEP
            idxs = [i for r in cohort.ranks.values() if now - r.last_seen_s <= timeout
                    and (i := r.max_step_index if step_kind else r.max_wall_index) != NO_INDEX]
            if len(idxs) < cohort.expected_ranks:
                # not every rank the cohort should have has reported yet (a first request can carry many
                # steps of one rank): closing by progress would judge windows its peers have not reached;
                # the grace period closes them if a rank stays away
                self.c["progress_close_deferred"] += 1
                continue
            due = due_by_progress(ws, idxs)
            if due is not None:
                self._close(cohort, ws, due, now)

    def _close(self, cohort: Cohort, ws: WindowSet, through: int, now: float) -> None:
        if ws.kind == KIND_STEP and through > cohort.step_ceiling:  # never moves the fence beyond the range
            through = cohort.step_ceiling
        for w in ws.pop_through(through, now):
            self._judge(cohort, w, now)

    def _judge(self, cohort: Cohort, w: Window, now: float) -> None:
        self.c["windows_closed"] += 1
        self._closed_flush += 1
        out = self.detector.judge(cohort, w, self._wall_ns())
        self.culprits.window(cohort, w.index, out.stage_excess, out.mp_waits)
        if self.metrics.registered:
            self.metrics.record_window(cohort.job, cohort.key, out, now)
            for alert in out.alerts.values():
                if alert is not None:  # judged slow in this window, or held from an earlier one
                    self._pending_alerts.append((alert, (alert.window_start, alert.window_end) == (w.start, w.end)))
            for v in out.verdicts:
                if v.verdict == s.VERDICT_RECOVERED:
                    self._pending_alerts.append((v, False))
        self._pending.extend(out.verdicts)

    def _record_alerts(self, now: float) -> None:
        """The alerts judged or held since the last call, each with the verdict that covers it (``node``), into
        the metrics; and each node verdict holding on a host whose alerts moved, refreshed (its cost judged)."""
        alerts, self._pending_alerts = self._pending_alerts, []
        judged: list[Verdict] = []
        hosts: set[tuple[str, str]] = set()
        groups: dict[tuple[str, str, int, str], Verdict] = {}  # a group verdict's alerts moved: refresh it
        for alert, was_judged in alerts:
            v = self.nodes.cover(self.culprits.cover(alert))
            covered = f"node:{v.node}" if v.node else v.victim_of
            self.metrics.record_alert(v, now, judged=was_judged, covered_by=covered)
            if v.node:
                hosts.add((v.job, v.node))
            if v.victim_of.startswith("group:"):
                key = self.culprits.key_of(v)
                if key is not None:
                    groups[(*key, v.stage)] = v
            if was_judged and covered:
                judged.append(alert)  # as judged: its own cost
        for job, host in sorted(hosts):
            node = self.nodes.alert(job, host, judged)
            if node is not None:
                self.metrics.record_alert(node, now, judged=any(a.job == job and a.host == host for a in judged))
        for job, run, dp, stage in sorted(groups):
            group = self.culprits.alert(job, run, dp, stage, judged)
            if group is not None:
                group, was_judged = group
                group = self.nodes.cover(group)
                self.metrics.record_alert(group, now, judged=was_judged,
                                          covered_by=f"node:{group.node}" if group.node else "")

    def _finish(self, now: float) -> None:
        """Flush counted telemetry, emit pending verdicts, publish the metrics snapshot."""
        if self._closed_flush:
            self.telemetry.windows_closed.inc(self._closed_flush)
            self._closed_flush = 0
        evicted_states = self.states.evicted - self.c["evicted_states"]
        if evicted_states:
            self.c["evicted_states"] = self.states.evicted
            self._evicted("detector_states", evicted_states)
        if self._evict_flush:
            for structure, n in self._evict_flush.items():
                self.telemetry.evictions.labels(structure=structure).inc(n)
            self._evict_flush = {}
        if self._pending:
            verdicts, self._pending = self._pending, []
            # node verdicts from the rank verdicts as judged (their own costs), then culprit and victims within
            # each model-parallel group; a group verdict on a host under a node verdict is covered by it
            verdicts = [self.nodes.cover(v) if v.derived else v
                        for v in self.culprits.observe(self.nodes.observe(verdicts, self.cohorts))]
            for v in verdicts:
                self.c["verdicts_" + v.verdict] = self.c.get("verdicts_" + v.verdict, 0) + 1
            if self.metrics.registered:
                self.metrics.count_verdicts(verdicts)
                for v in verdicts:
                    # a node or group verdict opened (pages) or ended; a collective signal has a gauge of its own
                    if (v.stage == s.NODE_STAGE or v.derived) and not v.ring:
                        self.metrics.record_alert(v, now, covered_by=f"node:{v.node}" if v.node else "")
            if self.cfg.emit_verdict_spans:
                room = _MAX_PENDING_SPANS - len(self._pending_spans)
                if room < len(verdicts):
                    self.c["verdict_spans_dropped"] += len(verdicts) - max(room, 0)
                self._pending_spans.extend(verdicts[:max(room, 0)])
            try:
                self._emit(verdicts)
            except Exception:  # fail open: a consumer's fault never stops detection
                self.c["emit_failures"] += 1
        if self._pending_alerts:
            self._record_alerts(now)
        if self.metrics.registered:
            self.metrics.publish(now)


