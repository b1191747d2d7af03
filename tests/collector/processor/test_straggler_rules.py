"""One test per detector rule, on hand-built requests with exact values. Where a rule can be switched off
through the config, the test also shows the outcome without it (so the assertion can fail)."""

from __future__ import annotations

import math

from straggler_build import span, step_request
from straggler_sim import Sim, make_processor, run

import otel_straggler_schema as s
from collector_processor.processor.straggler.config import Config
from jobsim.arrival import SimClock

PAR = 60.0


def feed(proc, steps, value_of, stage="forward-compute", group="forward", tokens_of=None, clock=None, ranks=8):  # type: ignore[no-untyped-def]
    """value_of(rank, step) -> (device, host) or None (rank silent that step)."""
    for st in steps:
        vals = {}
        for r in range(ranks):
            v = value_of(r, st)
            if v is not None:
                vals[r] = v
        toks = {r: tokens_of(r, st) for r in vals} if tokens_of else None
        proc.process_traces(step_request(st, vals, stage=stage, group=group, tokens=toks))
        if clock is not None:
            clock.t += 0.3


def kinds(emitted, rank=None, stage="forward-compute"):  # type: ignore[no-untyped-def]
    for v in emitted:  # every verdict speaks the schema's vocabulary
        assert v.verdict in s.VERDICTS and v.reason in s.REASONS and v.attribution in s.ATTRIBUTIONS
    return [(v.verdict, v.reason) for v in emitted if (rank is None or v.rank == rank) and v.stage == stage]


def stragglers(emitted):  # type: ignore[no-untyped-def]
    return [(v.rank, v.stage) for v in emitted if v.verdict == s.VERDICT_STRAGGLER]


def test_cohorts_are_never_compared_across_keys() -> None:
    """Rank 0..3 in cohort A at 60 ms, rank 4..7 in cohort B at 80 ms (another pipeline stage): no verdict."""
    proc, emitted, _ = make_processor()
    sim = Sim(cohort_of=lambda r: "A" if r < 4 else "B", noise=0.0,
              device_factor=lambda r, n, st: 1.33 if r >= 4 else 1.0)
    run(proc, sim, range(0, 60))
    assert stragglers(emitted) == []
    assert proc.stats()["cohorts"] == 2
    # the same data in one cohort convicts ranks 4..7 (the rule is what prevents it)
    proc2, emitted2, _ = make_processor()
    run(proc2, Sim(noise=0.0, device_factor=lambda r, n, st: 1.33 if r >= 4 else 1.0), range(0, 60))
    assert {r for r, _ in stragglers(emitted2)} == {4, 5, 6, 7}


def test_persistence_requires_consecutive_windows_and_flapping_never_fires() -> None:
    proc, emitted, _ = make_processor()
    # rank 3 slow in every other window (steps 10-14, 20-24, ...)
    feed(proc, range(0, 100), lambda r, st: ((PAR * 1.2 if r == 3 and (st // 5) % 2 == 0 else PAR), 10.0))
    assert stragglers(emitted) == []
    cfg = Config(persistence_windows=1)
    proc1, emitted1, _ = make_processor(cfg)
    feed(proc1, range(0, 100), lambda r, st: ((PAR * 1.2 if r == 3 and (st // 5) % 2 == 0 else PAR), 10.0))
    assert (3, "forward-compute") in stragglers(emitted1)


def test_a_gap_in_window_indices_resets_onset() -> None:
    """Slow in window 4, silent in window 5, slow in window 6: not consecutive, no straggler."""
    proc, emitted, _ = make_processor()

    def val(r, st):  # type: ignore[no-untyped-def]
        w = st // 5
        if r == 3 and w == 5:
            return None
        return (PAR * 1.2 if r == 3 and w in (4, 6) else PAR, 10.0)

    feed(proc, range(0, 35), val)
    assert stragglers(emitted) == []
    assert proc.stats()["windows_closed"] >= 6


def test_a_window_nobody_reported_breaks_persistence() -> None:
    """Steps 25-29 never arrive (e.g. an evaluation pause): slow windows 4 and 6 are not consecutive."""
    proc, emitted, _ = make_processor()
    steps = [st for st in range(0, 40) if not 25 <= st < 30]
    feed(proc, steps, lambda r, st: ((PAR * 1.2 if r == 3 and st // 5 in (4, 6) else PAR), 10.0))
    assert stragglers(emitted) == []
    proc2, emitted2, _ = make_processor()
    feed(proc2, range(0, 40), lambda r, st: ((PAR * 1.2 if r == 3 and st // 5 in (4, 5) else PAR), 10.0))
    assert stragglers(emitted2) == [(3, "forward-compute")]


def test_straggler_after_two_consecutive_slow_windows() -> None:
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 30), lambda r, st: ((PAR * 1.2 if r == 3 and st >= 10 else PAR), 10.0))
    assert stragglers(emitted) == [(3, "forward-compute")]
    v = next(v for v in emitted if v.verdict == s.VERDICT_STRAGGLER)
    assert (v.window_start, v.window_end, v.step) == (15, 19, 19)
    assert math.isclose(v.deviation or 0, 0.2)
    assert math.isclose(v.step_time_lost_ms, 12.0)
    assert v.cohort_size == 8


def test_reference_median_mode() -> None:
    cfg = Config(reference="median")
    proc, emitted, _ = make_processor(cfg)
    # rank 0 is a fast outlier at 40 ms, peers at 60, rank 7 at 66: +10% vs the median, +65% vs the fastest
    val = lambda r, st: ({0: 40.0, 7: 66.0}.get(r, PAR), 10.0)  # noqa: E731
    feed(proc, range(0, 30), val)
    v = [v for v in emitted if v.verdict == s.VERDICT_STRAGGLER]
    assert [x.rank for x in v] == [7]
    assert math.isclose(v[0].reference_ms or 0, 60.0)
    proc_f, emitted_f, _ = make_processor()
    feed(proc_f, range(0, 30), val)
    assert len(stragglers(emitted_f)) == 7


def test_absolute_floor_makes_tiny_stages_uncertain_and_rate_limited() -> None:
    proc, emitted, _ = make_processor()
    # 1 ms stage, rank 1 at +50%: relative beyond tolerance, absolute gap 0.5 ms under the 5 ms floor
    feed(proc, range(0, 200), lambda r, st: ((1.5 if r == 1 else 1.0), 2.0), stage="batch-generator", group="data")
    assert stragglers(emitted) == []
    unc = kinds(emitted, rank=1, stage="batch-generator")
    assert unc and set(unc) == {(s.VERDICT_UNCERTAIN, "below_absolute_floor")}
    # 37 judged windows (2 in warmup, the last still open): one on the change, then at most one per 20
    # windows; the rest are counted
    assert len(unc) == 2
    assert proc.stats()["uncertain_suppressed"] == 37 - 2
    # without the floor the same data convicts
    proc0, emitted0, _ = make_processor(Config(absolute_floor_ms=0.0))
    feed(proc0, range(0, 30), lambda r, st: ((1.5 if r == 1 else 1.0), 2.0), stage="batch-generator", group="data")
    assert stragglers(emitted0) == [(1, "batch-generator")]


def test_gap_under_floor_on_a_large_stage_is_uncertain_on_host_time_only() -> None:
    """The 5 ms floor guards host comparisons; device time of a stage of >= device_min_stage_ms is precise
    and judged against the device floor (0.5 ms): a 5 ms floor would block +5 % on every device-timed stage
    under 100 ms (docs/detection-defaults.md)."""
    # host-only (no CUDA): 60 ms stage, rank 2 at +7% = 4.2 ms: relative beyond tolerance, gap under 5 ms
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 40), lambda r, st: (None, (PAR * 1.07 if r == 2 else PAR)))
    assert stragglers(emitted) == []
    assert (s.VERDICT_UNCERTAIN, "below_absolute_floor") in kinds(emitted, rank=2)
    # the same gap on device time convicts
    proc_d, emitted_d, _ = make_processor()
    feed(proc_d, range(0, 40), lambda r, st: ((PAR * 1.07 if r == 2 else PAR), 10.0))
    assert stragglers(emitted_d) == [(2, "forward-compute")]
    # a device-timed stage under device_min_stage_ms (8 ms, launch-bound) keeps the host floor: +40% = 3.2 ms
    proc_s, emitted_s, _ = make_processor()
    feed(proc_s, range(0, 40), lambda r, st: ((8.0 * 1.4 if r == 2 else 8.0), 2.0))
    assert stragglers(emitted_s) == []
    assert (s.VERDICT_UNCERTAIN, "below_absolute_floor") in kinds(emitted_s, rank=2)
    # and without the minimum stage size it would convict
    proc_m, emitted_m, _ = make_processor(Config(device_min_stage_ms=0.0))
    feed(proc_m, range(0, 40), lambda r, st: ((8.0 * 1.4 if r == 2 else 8.0), 2.0))
    assert stragglers(emitted_m) == [(2, "forward-compute")]


def test_tolerance_rises_with_the_cohorts_measured_noise() -> None:
    """Noise-aware tolerance: rank 2 at +6 % is a straggler when per-step device noise is 1 %, but with 4 %
    per-step noise a 5-step median cannot tell +6 % from noise: the tolerance rises (noise_z) and no
    healthy rank is convicted either; with noise_z=0 the noisy cohort convicts healthy ranks."""
    import random

    def noisy(sigma: float, seed: int, slow: float):  # type: ignore[no-untyped-def]
        rng = random.Random(seed)
        return lambda r, st: (PAR * (slow if r == 2 else 1.0) * (1 + rng.gauss(0, sigma)), 10.0)

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 60), noisy(0.01, 1, 1.06))
    assert stragglers(emitted) == [(2, "forward-compute")]
    proc_n, emitted_n, _ = make_processor()
    feed(proc_n, range(0, 400), noisy(0.04, 2, 1.0))
    assert stragglers(emitted_n) == []
    proc_0, emitted_0, _ = make_processor(Config(noise_z=0.0))
    feed(proc_0, range(0, 400), noisy(0.04, 2, 1.0))
    assert stragglers(emitted_0) != []


def test_warmup_windows_are_excluded() -> None:
    """Lazy CUDA-event allocation: rank 4 is +25% in its first two windows only."""
    def val(r, st):  # type: ignore[no-untyped-def]
        return ((PAR * 1.25 if r == 4 and st < 10 else PAR), 10.0)

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 40), val)
    assert stragglers(emitted) == []
    assert proc.stats()["warmup_excluded"] == 16
    proc0, emitted0, _ = make_processor(Config(warmup_windows=0))
    feed(proc0, range(0, 40), val)
    assert stragglers(emitted0) == [(4, "forward-compute")]


def test_late_starting_rank_neither_blocks_windows_nor_is_judged_in_warmup() -> None:
    """Rank 7 starts at step 40 with warmup skew; windows before it close on the others' progress."""
    proc, emitted, _ = make_processor()

    def val(r, st):  # type: ignore[no-untyped-def]
        if r == 7:
            if st < 40:
                return None
            return (PAR * 1.3 if st < 50 else PAR, 10.0)
        return (PAR, 10.0)

    feed(proc, range(0, 40), val)
    assert proc.stats()["windows_closed"] == 7
    feed(proc, range(40, 90), val)
    assert stragglers(emitted) == []
    assert proc.stats()["windows_closed"] == 17


def test_unequal_workload_is_uncertain_and_excluded_from_references() -> None:
    """Rank 2 processes 20% more tokens and takes 20% longer; rank 5 processes 20% fewer and is faster."""
    def val(r, st):  # type: ignore[no-untyped-def]
        return ({2: PAR * 1.2, 5: PAR * 0.8}.get(r, PAR), 10.0)

    def tok(r, st):  # type: ignore[no-untyped-def]
        return {2: 9830, 5: 6554}.get(r, 8192)

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 40), val, tokens_of=tok)
    assert stragglers(emitted) == []
    assert (s.VERDICT_UNCERTAIN, "workload_incomparable") in kinds(emitted, rank=2)
    assert (s.VERDICT_UNCERTAIN, "workload_incomparable") in kinds(emitted, rank=5)
    # without token information the same timings convict rank 2 and, against rank 5, everyone else
    proc0, emitted0, _ = make_processor()
    feed(proc0, range(0, 40), val)
    assert (2, "forward-compute") in stragglers(emitted0)
    assert len(stragglers(emitted0)) == 7


def test_min_cohort_size_counts_only_comparable_peers() -> None:
    # a 2-rank cohort apart from its first window: the pair rule has no evidence of which one is slow
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 40), lambda r, st: ((PAR * 1.2 if r == 1 else PAR), 10.0), ranks=2)
    assert stragglers(emitted) == []
    assert kinds(emitted, rank=1) == [(s.VERDICT_UNCERTAIN, "pair_ambiguous")]
    proc1, emitted1, _ = make_processor(Config(pair=False))
    feed(proc1, range(0, 40), lambda r, st: ((PAR * 1.2 if r == 1 else PAR), 10.0), ranks=2)
    assert stragglers(emitted1) == []
    assert (s.VERDICT_UNCERTAIN, "cohort_below_min_size") in kinds(emitted1, rank=1)
    # 4 ranks reporting, but ranks 2 and 3 lost device timing: rank 1 has one comparable device peer
    proc2, emitted2, _ = make_processor()
    feed(proc2, range(0, 40), lambda r, st: ((PAR * 1.2 if r == 1 else PAR) if r < 2 else None, 10.0), ranks=4)
    assert stragglers(emitted2) == []
    assert (s.VERDICT_UNCERTAIN, "cohort_below_min_size") in kinds(emitted2, rank=1)
    proc3, emitted3, _ = make_processor(Config(min_cohort_size=2))
    feed(proc3, range(0, 40), lambda r, st: ((PAR * 1.2 if r == 1 else PAR), 10.0), ranks=2)
    assert stragglers(emitted3) == [(1, "forward-compute")]


def test_non_finite_samples_are_rejected_and_never_a_reference() -> None:
    """Rank 6 reports NaN/negative device and host times: counted, uncertain, never the fastest peer."""
    proc, emitted, _ = make_processor()
    rejected = []
    for st in range(0, 40):
        vals = {r: (PAR, 10.0) for r in range(8)}
        vals[6] = (math.nan, -1.0)
        vals[3] = (PAR * 1.2, 10.0) if st >= 10 else (PAR, 10.0)
        proc.process_traces(step_request(st, vals))
        rejected.append(proc.last_rejected)
    assert set(rejected) == {1}
    st = proc.stats()
    assert st["rejected_non_finite"] == 40 and st["non_finite_values"] == 80
    assert stragglers(emitted) == [(3, "forward-compute")]
    v = next(v for v in emitted if v.verdict == s.VERDICT_STRAGGLER)
    assert v.reference_rank != 6 and v.cohort_size == 7
    assert (s.VERDICT_UNCERTAIN, "non_finite_sample") in kinds(emitted, rank=6)


def test_device_and_host_are_never_mixed_in_one_comparison() -> None:
    """Peers: device 30 ms, host 40 ms. Rank 5 lost device timing (host 40 ms only). Mixing would make it
    +33% against a device reference; host-vs-host it is at par."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 40), lambda r, st: ((None, 40.0) if r == 5 else (30.0, 40.0)))
    assert stragglers(emitted) == []
    # and a rank whose host time is truly up against peers' host times is judged host-only
    proc2, emitted2, _ = make_processor()
    feed(proc2, range(0, 40), lambda r, st: ((None, 40.0) if r >= 5 else (30.0, 40.0)) if r != 6
         else (None, 50.0))
    v = [v for v in emitted2 if v.verdict == s.VERDICT_STRAGGLER]
    assert [(x.rank, x.measurement, x.attribution, x.reference_ms) for x in v] == [
        (6, s.MEASUREMENT_HOST_ONLY, s.ATTRIBUTION_HOST, 40.0)]


def test_recovery_needs_positive_evidence_and_unusable_windows_hold_the_alert() -> None:
    proc, emitted, _ = make_processor()
    slow = lambda r, st: ((PAR * 1.2 if r == 3 else PAR), 10.0)  # noqa: E731
    feed(proc, range(0, 30), slow)
    assert stragglers(emitted) == [(3, "forward-compute")]
    # rank 3's work becomes incomparable (while at par): no recovery, alert held, reported once
    feed(proc, range(30, 50), lambda r, st: (PAR, 10.0), tokens_of=lambda r, st: 12000 if r == 3 else 8192)
    k = kinds(emitted, rank=3)
    assert (s.VERDICT_RECOVERED, "within_tolerance") not in k
    assert k.count((s.VERDICT_UNCERTAIN, "recovery_evidence_insufficient")) == 1
    assert [a.rank for a in proc.active()] == [3]
    # rank 3 silent for a while: still held, not reported again
    feed(proc, range(50, 60), lambda r, st: None if r == 3 else (PAR, 10.0))
    assert [a.rank for a in proc.active()] == [3]
    assert kinds(emitted, rank=3).count((s.VERDICT_UNCERTAIN, "recovery_evidence_insufficient")) == 1
    # still slow when evidence returns: held, no new onset verdict
    feed(proc, range(60, 75), slow)
    assert stragglers(emitted) == [(3, "forward-compute")]
    # at par (gap 0 is under the floor: the floor never blocks recovery)
    feed(proc, range(75, 90), lambda r, st: (PAR, 10.0))
    assert kinds(emitted, rank=3)[-1] == (s.VERDICT_RECOVERED, "within_tolerance")
    assert proc.active() == []


def test_grace_closes_a_window_held_by_a_silent_rank() -> None:
    clock = SimClock()
    cfg = Config(warmup_windows=0, rank_timeout_s=1000.0)
    proc, _, _ = make_processor(cfg, clock)
    feed(proc, range(0, 5), lambda r, st: (PAR, 10.0), clock=clock)
    t5 = clock.t  # step 5 (first sample of window 1) arrives now
    feed(proc, range(5, 12), lambda r, st: None if r == 7 else (PAR, 10.0), clock=clock)  # rank 7 silent
    assert proc.stats()["windows_closed"] == 0  # window 0 waits for rank 7 (step 4 was its last)
    proc.tick(t5 + cfg.grace_s - 0.1)
    assert proc.stats()["windows_closed"] == 0
    proc.tick(t5 + cfg.grace_s + 0.1)
    assert proc.stats()["windows_closed"] == 1
    assert proc.stats()["windows_closed_by_grace"] == 1
    proc.tick(t5 + 10 * 0.3 + cfg.grace_s + 0.1)  # window 2 began at step 10
    assert proc.stats()["windows_closed"] == 2


def test_wall_clock_windows_without_iteration() -> None:
    """No dl.iteration: windows of wall_window_s from the cohort's first observation, closed by progress
    or tick; integer arithmetic keeps 4.1 s and 4.0 s in the same 1 s... boundaries exact."""
    clock = SimClock()
    cfg = Config(wall_window_s=1.0, warmup_windows=1)
    proc, emitted, _ = make_processor(cfg, clock)
    t0 = 1_700_000_000_000_000_000 + 123  # anchor is not a whole second: boundaries follow it
    from straggler_build import request
    for i in range(40):  # 4 samples per second per rank
        start = t0 + i * 250_000_000
        proc.process_traces(request({r: [span("forward-compute", None, PAR * 1.2 if r == 2 else PAR, 10.0,
                                               start_ns=start)] for r in range(6)}))
        clock.t += 0.25
    proc.tick(clock.t + 100)
    assert stragglers(emitted) == [(2, "forward-compute")]
    v = next(v for v in emitted if v.verdict == s.VERDICT_STRAGGLER)
    assert v.step is None and v.trace_id == b""
    assert proc.stats()["windows_closed"] == 10


def test_host_up_with_device_flat_is_a_host_only_stall() -> None:
    """Device measured and at par, host interval +20 ms (e.g. the rank waits for its data loader): the step
    is delayed by the host; the verdict compares host-vs-host and says host_only_stall."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 30), lambda r, st: (30.0, 40.0 if r == 2 and st >= 10 else 20.0), stage="batch-generator",
         group="data")
    v = [x for x in emitted if x.verdict == s.VERDICT_STRAGGLER]
    assert [(x.rank, x.measurement, x.attribution, x.reference_ms) for x in v] == [
        (2, s.MEASUREMENT_HOST_ONLY, s.ATTRIBUTION_HOST, 20.0)]
    feed(proc, range(30, 45), lambda r, st: (30.0, 20.0), stage="batch-generator", group="data")
    assert kinds(emitted, rank=2, stage="batch-generator")[-1] == (s.VERDICT_RECOVERED, "within_tolerance")


def test_a_data_loader_stall_that_stretches_the_device_interval_is_the_hosts() -> None:
    """The data loader's work is the host's: waiting for a batch stretches its device interval as much (the
    stream idles between the stage's events). Device and host both +20 ms is a host_only_stall, never a GPU
    stall, although the device excess explains the host's as a blocked host tracking a slow GPU would."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 30), lambda r, st: (40.0, 40.0) if r == 2 and st >= 10 else (20.0, 20.0),
         stage="batch-generator", group="data")
    v = [x for x in emitted if x.verdict == s.VERDICT_STRAGGLER]
    assert [(x.rank, x.measurement, x.attribution) for x in v] == [(2, s.MEASUREMENT_DEVICE, s.ATTRIBUTION_HOST)]


def test_noise_raised_tolerance_never_clears_an_alert() -> None:
    """Recovery needs the deviation back within the base tolerance: a noisy window whose raised tolerance
    covers a still-slow rank holds the alert (the demo's host-timed rank "recovered" at +12 % without this)."""
    import random

    rng = random.Random(4)

    def val(r, st):  # type: ignore[no-untyped-def]
        sigma = 0.06 if 40 <= st < 80 else 0.005  # noisy phase: raised tolerance ~20 %
        slow = 1.2 if st < 40 else (1.1 if st < 80 else 1.0)  # still +10 % in the noisy phase, then par
        return (PAR * (slow if r == 2 else 1.0) * (1 + rng.gauss(0, sigma)), 10.0)

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 40), val)
    assert stragglers(emitted) == [(2, "forward-compute")]
    feed(proc, range(40, 80), val)
    assert (s.VERDICT_RECOVERED, "within_tolerance") not in kinds(emitted, rank=2)
    assert [v.rank for v in proc.active()] == [2]
    feed(proc, range(80, 110), val)
    assert (s.VERDICT_RECOVERED, "within_tolerance") in kinds(emitted, rank=2)
    assert proc.active() == []


def _first_straggler_step(emitted):  # type: ignore[no-untyped-def]
    return next((v.step for v in emitted if v.verdict == s.VERDICT_STRAGGLER), None)


def test_sequential_evidence_convicts_a_slowdown_starting_mid_window_one_window_earlier() -> None:
    """Rank 3 +6 % from step 22, step 22 itself only +2 %: window 4 (steps 20-24) has median +2 %, under the
    4 % tolerance, window 5 is slow. The two-window rule waits for window 6; the per-step excess of steps
    22-29 spans windows 4 and 5, each averaging beyond the margin: the verdict comes at the end of window 5."""
    def val(r, st):  # type: ignore[no-untyped-def]
        if r != 3 or st < 22:
            return (PAR, 10.0)
        return (PAR * (1.02 if st == 22 else 1.06), 10.0)

    on, emitted_on, _ = make_processor()
    feed(on, range(0, 45), val)
    off, emitted_off, _ = make_processor(Config(sequential=False))
    feed(off, range(0, 45), val)
    assert _first_straggler_step(emitted_on) == 29  # end of window 5
    assert _first_straggler_step(emitted_off) == 34  # end of window 6: two consecutive slow windows


def test_sequential_evidence_after_a_slow_window_and_a_narrow_miss() -> None:
    """Window 4 slow (+6 %), window 5 narrowly under the tolerance (median +3.5 %): the per-step excess of
    both is beyond the margin, so the verdict comes at the end of window 5 (reporting the lookback's means
    against the peers' medians); without sequential_excess the streak resets and windows 6 + 7 are needed."""
    def val(r, st):  # type: ignore[no-untyped-def]
        if r != 3 or st < 20:
            return (PAR, 10.0)
        if st in (25, 26, 27):
            return (PAR * 1.035, 10.0)  # window 5's median at +3.5 %: under 4 %
        return (PAR * 1.06, 10.0)

    on, emitted_on, _ = make_processor()
    feed(on, range(0, 45), val)
    off, emitted_off, _ = make_processor(Config(sequential=False))
    feed(off, range(0, 45), val)
    first = next(v for v in emitted_on if v.verdict == s.VERDICT_STRAGGLER)
    assert (first.step, first.reason, first.attribution) == (29, "persistent_excess", s.ATTRIBUTION_GPU)
    assert first.deviation is not None and abs(first.deviation - 0.06) < 1e-9  # the lookback's median, not window 5's
    assert first.reference_rank is None and first.reference_ms == PAR
    assert _first_straggler_step(emitted_off) == 39


def test_sequential_evidence_when_a_window_median_dips_under_the_margin() -> None:
    """Rank 3 +6 % from step 20; in window 5 (steps 25-29) three steps are only +2 %, so the window's median
    (+2 %) is under the 2.5 % margin. Its steps still carry evidence of their own (each +2 % step is beyond the
    spread here), the lookback's median is +6 %: sequential_excess convicts at the end of window 5. Without it
    (and with a margin on each window's median) the verdict waits for windows 6 + 7."""
    def val(r, st):  # type: ignore[no-untyped-def]
        if r != 3 or st < 20:
            return (PAR, 10.0)
        return (PAR * (1.02 if st in (27, 28, 29) else 1.06), 10.0)

    on, emitted_on, _ = make_processor()
    feed(on, range(0, 45), val)
    off, emitted_off, _ = make_processor(Config(sequential=False))
    feed(off, range(0, 45), val)
    first = next(v for v in emitted_on if v.verdict == s.VERDICT_STRAGGLER)
    assert (first.rank, first.step, first.reason) == (3, 29, "persistent_excess")
    assert _first_straggler_step(emitted_off) == 39


# --- sequential_excess -------------------------------------------------------------------------------------

def _first(emitted, rank=3):  # type: ignore[no-untyped-def]
    return next((v for v in emitted if v.verdict == s.VERDICT_STRAGGLER and v.rank == rank), None)


def test_sequential_evidence_finds_a_small_slowdown_the_window_rules_miss_in_noise() -> None:
    """2 % per-step noise, rank 3 +5 % on a 60 ms stage from step 43 (mid-window). Window medians against
    the fastest of seven peers need a ~6.7 % noise-raised tolerance there; the per-step excess over the
    peers' median adds up: found within 15 steps, by sequential_excess, as a GPU stall. Without it: not within
    15."""
    def sim() -> Sim:
        return Sim(seed=11, noise=0.02, device_factor=lambda r, n, st: 1.05 if (r == 3 and n == "forward-compute"
                                                                                and st >= 43) else 1.0)
    on, emitted_on, _ = make_processor()
    run(on, sim(), range(0, 120))
    off, emitted_off, _ = make_processor(Config(sequential=False))
    run(off, sim(), range(0, 120))
    v = _first(emitted_on)
    assert v is not None and v.step is not None and v.step - 43 <= 15
    # the window it fired in may be slow on its own (then reported against the fastest peer, window_excess)
    assert (v.stage, v.attribution) == ("forward-compute", s.ATTRIBUTION_GPU)
    assert v.reason in ("persistent_excess", "slower_than_reference")
    assert v.deviation is not None and 0.02 < v.deviation < 0.12
    assert stragglers(emitted_on) == [(3, "forward-compute")]  # nobody else
    late = _first(emitted_off)
    assert late is None or (late.step is not None and late.step - 43 > 15)


def test_sequential_evidence_never_convicts_one_window_or_a_spike() -> None:
    """Exact values (spread at its floor): one +30 % window after par, five +30 % steps straddling two windows
    (one step in window 14, four in window 15: both windows' steps slow), or two
    single-step x3 spikes in consecutive windows, add at most a capped step each and fall back to 0: no
    verdict. Two consecutive +3 % windows do convict (so the rule is live here)."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 60), lambda r, st: ((PAR * 1.3 if r == 3 and st // 5 == 6 else PAR), 10.0))
    feed(proc, range(60, 100), lambda r, st: ((PAR * 1.3 if r == 3 and 74 <= st <= 78 else PAR), 10.0))
    feed(proc, range(100, 140), lambda r, st: ((PAR * 3 if r == 3 and st in (114, 115) else PAR), 10.0))
    assert stragglers(emitted) == []
    feed(proc, range(140, 170), lambda r, st: ((PAR * 1.03 if r == 3 and st >= 150 else PAR), 10.0))
    v = _first(emitted)
    assert v is not None and v.reason == "persistent_excess" and v.step == 159


def test_sequential_alert_holds_while_the_excess_persists_and_recovers_at_par() -> None:
    """A +3 % rank convicted by sequential_excess sits within the 4 % window tolerance: the alert holds while its
    per-step excess stays beyond the margin (no straggler/recovered flapping), and recovers at par."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 80), lambda r, st: ((PAR * 1.03 if r == 3 and st >= 20 else PAR), 10.0))
    assert kinds(emitted, rank=3) == [(s.VERDICT_STRAGGLER, "persistent_excess")]
    assert [a.rank for a in proc.active()] == [3]
    feed(proc, range(80, 95), lambda r, st: (PAR, 10.0))
    assert kinds(emitted, rank=3) == [(s.VERDICT_STRAGGLER, "persistent_excess"),
                                      (s.VERDICT_RECOVERED, "within_tolerance")]
    assert proc.active() == []


def test_sequential_evidence_attributes_a_host_stall_to_the_host() -> None:
    """Device +12 % (7 ms) and host +20 ms on the same steps: 13 ms of host excess the device does not explain,
    a host stall that starved the stream part of the time. (The window rules, host_stall included, are out of
    the way: the per-step path attributes by the same rule as they do.)"""
    proc, emitted, _ = make_processor(Config(tolerance=0.2, noise_z=0, host_stall_groups=["data"]))
    feed(proc, range(0, 60), lambda r, st: ((PAR * 1.12, 30.0) if r == 3 and st >= 22 else (PAR, 10.0)))
    v = _first(emitted)
    assert v is not None and v.reason == "persistent_excess" and v.attribution == s.ATTRIBUTION_HOST


def test_a_slow_gpu_with_a_blocked_host_is_a_gpu_stall_on_both_paths() -> None:
    """GPU-bound (the host blocks on a full launch queue, so its time tracks the device's): rank 3's GPU slows
    forward-compute by 10 % (window_excess) and backward-compute by 3 % (sequential_excess) in the same steps;
    host excess = device excess on both. The device explains the host: gpu_stream_stall on both paths (the
    ratio rule said host_only_stall for the window path and gpu_stream_stall for the per-step one)."""
    proc, emitted, _ = make_processor()
    for st in range(0, 60):
        for stage, group, base, slow in (("forward-compute", "forward", PAR, 1.10),
                                          ("backward-compute", "backward", 2 * PAR, 1.03)):
            vals = {r: (base * (slow if r == 3 and st >= 20 else 1.0),) * 2 for r in range(8)}
            proc.process_traces(step_request(st, vals, stage=stage, group=group))
    got = {(v.stage, v.reason, v.attribution) for v in emitted if v.verdict == s.VERDICT_STRAGGLER}
    assert got == {("forward-compute", "slower_than_reference", s.ATTRIBUTION_GPU),
                   ("backward-compute", "persistent_excess", s.ATTRIBUTION_GPU)}


def test_sequential_evidence_skips_ranks_with_unequal_work() -> None:
    """Rank 5 does 20 % more tokens and is 20 % slower: uncertain (workload), never a straggler, and not the
    reference of rank 3's per-step comparison (rank 3 at par is not convicted by comparison with it)."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 80), lambda r, st: ((PAR * 1.2 if r == 5 else PAR), 10.0),
         tokens_of=lambda r, st: 9830 if r == 5 else 8192)
    assert stragglers(emitted) == []
    assert (s.VERDICT_UNCERTAIN, "workload_incomparable") in kinds(emitted, rank=5)
    proc2, emitted2, _ = make_processor()
    feed(proc2, range(0, 80), lambda r, st: ((PAR * 1.2 if r == 5 else PAR), 10.0))
    assert stragglers(emitted2) == [(5, "forward-compute")]  # without tokens it is convicted


def test_sequential_alert_holds_in_noise_without_flapping() -> None:
    """+3 % at 1 % noise: convicted once by sequential_excess; the alert holds while the window's mean excess
    stays beyond half the margin (hysteresis), so it does not recover on one noisy window and get convicted
    again (without hysteresis: 11-15 straggler/recovered pairs in 600 steps)."""
    sim = Sim(seed=0, noise=0.01, device_factor=lambda r, n, st: 1.03 if (r == 3 and n == "forward-compute"
                                                                         and st >= 20) else 1.0)
    proc, emitted, _ = make_processor()
    run(proc, sim, range(0, 300))
    got = [(v.verdict, v.reason) for v in emitted if v.rank == 3 and v.stage == "forward-compute"
           and v.verdict != s.VERDICT_UNCERTAIN]
    assert got == [(s.VERDICT_STRAGGLER, "persistent_excess")]


def test_a_window_missing_one_device_sample_still_counts_as_full() -> None:
    """Auto sampling's host-only probe (every 16th step with N = 1) leaves a window 4 device samples: it
    still counts as a full window for persistence, so a 2x slowdown of an 8 ms stage (sequential_excess skips
    stages under 10 ms) is convicted at step 34 with or without probes (not until step 39 if a window with
    a probe counted only its 4 samples)."""
    def first(probe: bool):  # type: ignore[no-untyped-def]
        proc, emitted, _ = make_processor()
        feed(proc, range(0, 60), lambda r, st: (None if (probe and st % 16 == 15) else
                                                8.0 * (2.0 if r == 3 and st >= 25 else 1.0), 1.0),
             stage="optimizer", group="optimizer")
        return _first_straggler_step(emitted)

    assert first(False) == 34
    assert first(True) == 34


def test_recovery_needs_persistent_par_and_never_flaps_on_a_rising_ramp() -> None:
    """A thermal ramp: rank 3's GPU slows by 0.1 % per step from step 20; one window reads near par (+1 %, noise)
    while the excess still rises. One window at par is no recovery (recovery_windows = 2): a single alert, no
    recovered/straggler pair; two windows at par, at the end, recover it. With recovery_windows = 1 the near-par
    window recovers it and the ramp is convicted again."""
    def ramp(r, st):  # type: ignore[no-untyped-def]
        if r != 3 or st < 20 or st >= 100:
            return (PAR, 10.0)
        return (PAR * (1.01 if 60 <= st < 65 else 1.0 + 0.001 * (st - 20)), 10.0)

    proc, emitted, _ = make_processor()
    feed(proc, range(0, 100), ramp)
    assert kinds(emitted, rank=3) == [(s.VERDICT_STRAGGLER, "persistent_excess")]
    feed(proc, range(100, 106), ramp)
    assert kinds(emitted, rank=3)[-1] == (s.VERDICT_STRAGGLER, "persistent_excess")  # one window at par: held
    feed(proc, range(106, 111), ramp)
    assert kinds(emitted, rank=3)[-1] == (s.VERDICT_RECOVERED, "within_tolerance")

    proc, emitted, _ = make_processor(Config(recovery_windows=1))
    feed(proc, range(0, 100), ramp)
    assert [k[0] for k in kinds(emitted, rank=3)] == [s.VERDICT_STRAGGLER, s.VERDICT_RECOVERED,
                                                      s.VERDICT_STRAGGLER]


def test_recovery_needs_a_margin_well_inside_tolerance() -> None:
    """A host stall (data loader, host +20 ms) eases to +3 %: within the 4 % tolerance of the fastest peer but
    beyond the recovery margin (2 % of the peers' median): the alert holds; at par it recovers."""
    proc, emitted, _ = make_processor()
    feed(proc, range(0, 30), lambda r, st: (30.0, 40.0 if r == 2 and st >= 10 else 20.0), stage="batch-generator",
         group="data")
    feed(proc, range(30, 60), lambda r, st: (30.0, 20.6 if r == 2 else 20.0), stage="batch-generator", group="data")
    assert [v.verdict for v in emitted if v.rank == 2] == [s.VERDICT_STRAGGLER]
    assert [a.rank for a in proc.active()] == [2]
    feed(proc, range(60, 75), lambda r, st: (30.0, 20.0), stage="batch-generator", group="data")
    assert kinds(emitted, rank=2, stage="batch-generator")[-1] == (s.VERDICT_RECOVERED, "within_tolerance")
    proc, emitted, _ = make_processor(Config(recovery_margin=0.04))
    feed(proc, range(0, 30), lambda r, st: (30.0, 40.0 if r == 2 and st >= 10 else 20.0), stage="batch-generator",
         group="data")
    feed(proc, range(30, 60), lambda r, st: (30.0, 20.6 if r == 2 else 20.0), stage="batch-generator", group="data")
    assert s.VERDICT_RECOVERED in [v.verdict for v in emitted if v.rank == 2]


def test_a_noisy_rank_back_at_par_recovers_promptly() -> None:
    """Host-timed data loader at 8 % per-step noise: a 2 % margin is under one standard error of a window
    median, so a rank at par rarely shows it twice in a row; the margin rises to two standard errors (at most
    the 4 % tolerance). 10 seeded runs, rank 2 stalled +100 % for steps 10-39: every one recovers, at least 8
    within 15 steps of the stall's end (6 with a fixed 2 % margin), and nobody else is convicted."""
    import random

    recovered = []
    for seed in range(10):
        rng = random.Random(seed)
        proc, emitted, _ = make_processor()
        feed(proc, range(0, 150), lambda r, st, rng=rng: (None, 20.0 * (2.0 if r == 2 and 10 <= st < 40 else 1.0)
                                                         * (1 + rng.gauss(0, 0.08))),
             stage="batch-generator", group="data")
        assert stragglers(emitted) == [(2, "batch-generator")]
        recovered.append(next(v.step for v in emitted if v.rank == 2 and v.verdict == s.VERDICT_RECOVERED))
    assert sum(1 for st in recovered if st <= 40 + 15) >= 8, recovered
