"""Cohorts budgeted per tenant: a tenant at or over its share of ``max_cohorts`` evicts only its own cohorts, so a
flood of one tenant's one-span cohorts never evicts another tenant's cohort held under its share; evictions are
counted per tenant."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from collector_processor.processor.straggler.cohort import CohortRegistry
from collector_processor.tenancy import Tenancy


def _registry(max_cohorts: int) -> tuple[CohortRegistry, Counter]:
    evictions = Counter("ev", "x", ["tenant", "structure"], registry=CollectorRegistry())
    tenancy = Tenancy([("a", ["job-a", "team-a/*"]), ("b", ["job-b"])])
    return CohortRegistry(max_cohorts, tenancy, evictions), evictions


def _evicted(ev: Counter, tenant: str) -> float:
    return ev.labels(tenant=tenant, structure="cohorts")._value.get()


def test_a_flood_of_one_tenants_cohorts_evicts_only_its_own() -> None:
    reg, ev = _registry(8)
    for i in range(3):
        reg.get("job-b", f"c{i}", 0.0)
    for i in range(500):  # tenant a: a new cohort per span, in two of its jobs
        _, evicted = reg.get("job-a" if i % 2 else f"team-a/{i}", f"c{i}", 1.0 + i)
        assert evicted is None or evicted.tenant == "a"
    assert [reg.find("job-b", f"c{i}") is not None for i in range(3)] == [True] * 3
    assert len(reg) == 8 and reg.held_by("b") == 3 and reg.held_by("a") == 5
    assert _evicted(ev, "a") == 500 - 5 and _evicted(ev, "b") == 0


def test_a_tenant_over_its_share_gives_way_to_a_newcomer() -> None:
    """Tenant a fills the registry alone; b's new cohorts take a's least recently seen until b holds its share."""
    reg, ev = _registry(8)
    for i in range(8):
        reg.get("job-a", f"c{i}", float(i))
    for i in range(4):
        _, evicted = reg.get("job-b", f"c{i}", 10.0 + i)
        assert evicted is not None and (evicted.tenant, evicted.key) == ("a", f"c{i}")
    _, evicted = reg.get("job-b", "c4", 20.0)  # at its share (8 // 2): b now evicts its own
    assert evicted is not None and (evicted.tenant, evicted.key) == ("b", "c0")
    assert reg.held_by("a") == 4 and reg.held_by("b") == 4
    assert _evicted(ev, "a") == 4 and _evicted(ev, "b") == 1


def test_jobs_no_tenant_lists_share_one_budget_and_recency_counts() -> None:
    reg, _ = _registry(3)
    for i in range(3):
        reg.get("other", f"c{i}", float(i))
    reg.get("other", "c0", 5.0)  # seen again: c1 is now the least recently seen
    _, evicted = reg.get("other", "c3", 6.0)
    assert evicted is not None and evicted.key == "c1" and evicted.tenant == ""
    assert Tenancy([("a", ["team-a/*", "team-a/x/*"]), ("b", ["team-a/x/y"])])("team-a/x/y") == "b"


def test_with_job_tokens_every_job_is_its_own_tenant() -> None:
    """Per-job tokens (``auth.job_secret``): a job no tenant lists has a budget of its own, counted under one
    bounded label."""
    evictions = Counter("ev", "x", ["tenant", "structure"], registry=CollectorRegistry())
    tenancy = Tenancy([("a", ["job-a"])], per_job=True)
    assert tenancy("job-a") == "a" and tenancy("j1") == "job:j1" != tenancy("j2")
    reg = CohortRegistry(8, tenancy, evictions)
    for i in range(3):
        reg.get("j1", f"c{i}", 0.0)
    for i in range(100):
        _, evicted = reg.get("j2", f"c{i}", 1.0 + i)
        assert evicted is None or evicted.job == "j2"
    assert reg.held_by("job:j1") == 3
    assert evictions.labels(tenant="job-tokens", structure="cohorts")._value.get() == 95


def test_a_tenants_jobs_hold_at_most_its_share_of_the_dashboard_series() -> None:
    """``max_series`` 100 with tenants a and b (and the jobs none lists): each holds at most a third of it, its
    per-rank series 90 % of that; a's flood of ranks is refused beyond (counted for a), b's ranks still get theirs,
    a flood of a's job-level series (one per run) stops at its share too, and expired series give their places
    back."""
    from collector_processor.processor.straggler.config import MetricsConfig
    from collector_processor.processor.straggler.metrics import StragglerMetrics
    from collector_processor.processor.straggler.window_evidence import WindowOutcome
    from collector_processor.telemetry import Telemetry

    tel = Telemetry()
    tenancy = Tenancy([("a", ["job-a"]), ("b", ["job-b"])])
    m = StragglerMetrics(MetricsConfig(max_series=100, series_ttl_s=10.0), tel, tenancy)
    flood = WindowOutcome(rank_deviation={r: 0.1 for r in range(500)})
    m.record_window("job-a", "c0", flood, 0.0)
    assert m._tenant_series == {"a": 30}
    for run in range(10):  # job-level series, one per run: up to a's whole share
        m.record_seen("job-a", 0.0, run=f"r{run}")
    assert m._tenant_series == {"a": 33}
    m.record_window("job-b", "c0", WindowOutcome(rank_deviation={r: 0.1 for r in range(20)}), 0.0)
    assert m._tenant_series == {"a": 33, "b": 20}
    refused = tel.registry.get_sample_value("otel_straggler_collector_tenant_evictions_total",
                                            {"tenant": "a", "structure": "metric_series"})
    assert refused == 500 - 30 + 10 - 3
    assert not tel.registry.get_sample_value("otel_straggler_collector_tenant_evictions_total",
                                             {"tenant": "b", "structure": "metric_series"})
    m.record_window("job-b", "c0", WindowOutcome(rank_deviation={r: 0.1 for r in range(20)}), 20.0)
    m.publish(20.0)  # a's series are 20 s old: expired, their places given back
    assert m._tenant_series == {"b": 20}
