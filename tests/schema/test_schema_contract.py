"""The schema document and the schema module describe the same contract, name for name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import otel_straggler_schema as s

DOC = (Path(__file__).resolve().parents[2] / "docs" / "schema.md").read_text(encoding="utf-8")
PREFIXES = ("RES_", "ATTR_", "EV_", "M_", "SM_", "SPAN_")


def _constants() -> dict[str, str]:
    return {k: v for k, v in vars(s).items() if k.startswith(PREFIXES) and isinstance(v, str)}


def _documented_names() -> set[str]:
    names: set[str] = set()
    for cell in re.findall(r"`([^`]+)`", DOC):
        for part in re.split(r"\s*/\s*", cell):
            names.add(part.strip())
    # "`dl.tensor_parallel.rank` / `.size`" style: expand the suffix cells against the previous name
    for base, suffix in re.findall(r"`([a-z_.]+)\.[a-z_]+` / `\.([a-z_]+)`", DOC):
        names.add(f"{base}.{suffix}")
    return names


def test_every_constant_is_documented() -> None:
    documented = _documented_names()
    missing = sorted(
        f"{k}={v}" for k, v in _constants().items()
        if v not in documented and not (k == "M_EMITTER_PREFIX" and "otel_straggler_emitter_<name>_total" in DOC)
        and not k.startswith("SM_REASON")
    )
    assert not missing, f"constants missing from docs/schema.md: {missing}"


def test_every_documented_metric_is_a_constant() -> None:
    values = set(_constants().values())
    doc_metrics = set(re.findall(r"`(otel_straggler_[a-z_]+)`", DOC))
    unknown = sorted(m for m in doc_metrics if m not in values and not m.startswith(s.M_EMITTER_PREFIX)
                     and m not in {"otel_straggler_schema", "otel_straggler_demo"})  # package names
    assert not unknown, f"metrics in docs/schema.md without a constant in otel_straggler_schema: {unknown}"
    doc_instruments = set(re.findall(r"`(otel_straggler\.emitter\.[a-z_.]+)`", DOC))
    assert doc_instruments <= values, sorted(doc_instruments - values)


def test_every_documented_attribute_is_a_constant() -> None:
    values = set(_constants().values())
    rows = re.findall(r"^\| `((?:dl|straggler|host|service|process)\.[a-z_.]+)`", DOC, flags=re.M)
    unknown = sorted(r for r in rows if r not in values)
    assert not unknown, f"attributes in docs/schema.md without a constant: {unknown}"


def test_enumerations_are_documented() -> None:
    for value in (*s.VERDICTS, *s.REASONS, *s.ATTRIBUTIONS, *s.DEGRADED_REASONS, *s.STAGE_GROUPS,
                  *s.SM_DROPPED_REASONS, *s.SM_FAULT_WHERES, *s.COLLECTOR_DROPPED_REASONS,
                  *s.COLLECTOR_REJECTED_REASONS, *s.COLLECTOR_REQUEST_OUTCOMES):
        assert f"`{value}`" in DOC, value


def test_collector_counter_label_lists_are_the_documented_and_counted_values() -> None:
    """The reasons and outcomes the collector reports at 0 from the start are exactly those its table row lists,
    and the rejection reasons are the ones the straggler processor counts."""
    from collector_processor.processor.straggler import decode

    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(otel_straggler_collector_[a-z_]+)` \|[^|]*\|[^|]*\|"
                                                        r"([^\n]*)\|$", DOC, flags=re.M)}

    def listed(metric: str) -> list[str]:
        return re.findall(r"`([a-z_]+)`", rows[metric].split(";")[0])

    assert listed(s.M_SPANS_DROPPED) == list(s.COLLECTOR_DROPPED_REASONS)
    assert listed(s.M_SPANS_REJECTED) == list(s.COLLECTOR_REJECTED_REASONS)
    assert listed(s.M_REQUESTS) == list(s.COLLECTOR_REQUEST_OUTCOMES)
    assert {v for k, v in vars(decode).items() if k.startswith("REJECT_")} == set(s.COLLECTOR_REJECTED_REASONS)


def test_emitter_self_metrics_use_base_units_and_no_unit_in_the_name() -> None:
    """Each emitter instrument's unit in docs/schema.md is a base unit (``1`` or ``s``) and is the unit the
    emitter registers; no instrument name carries a unit (the unit is metadata, a suffix only in Prometheus)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_straggler.export.selfmetrics import SelfMetrics

    documented = dict(re.findall(r"^\| `(otel_straggler\.emitter\.[a-z_.]+)` \| (?:counter|gauge) \| `([^`]+)` \|",
                                 DOC, flags=re.M))
    instruments = {v for k, v in _constants().items() if k.startswith("SM_") and v.startswith("otel_straggler.")}
    assert set(documented) == instruments
    assert set(documented.values()) <= {"1", "s"}
    assert not [n for n in instruments if re.search(r"[._](ms|us|ns|s|seconds|millis|bytes)$", n)]
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    SelfMetrics(provider.get_meter("contract"), dict)
    registered = {m.name: m.unit for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics}
    provider.shutdown()
    assert registered == documented


def test_trace_id_rule_is_deterministic_and_shared_by_ranks() -> None:
    a = s.trace_id_for_step("job-1", 7)
    assert a == s.trace_id_for_step("job-1", 7)
    assert a != s.trace_id_for_step("job-1", 8)
    assert a != s.trace_id_for_step("job-2", 7)
    assert 0 < a < 2**128
    assert s.rank_step_span_id("job-1", 7, 0) != s.rank_step_span_id("job-1", 7, 1)
    assert 0 < s.job_step_span_id("job-1", 7) < 2**64


def test_cohort_key_excludes_data_parallel_and_includes_epoch() -> None:
    base = dict(stage_schema="megatron-v1", tp=1, pp=2, cp=0, ep=3)
    assert s.cohort_key(topology_epoch=0, **base) == s.cohort_key(topology_epoch=0, **base)
    assert s.cohort_key(topology_epoch=0, **base) != s.cohort_key(topology_epoch=1, **base)
    assert "dp" not in s.cohort_key(topology_epoch=0, **base)
    assert s.cohort_key(topology_epoch=0, **base) != s.cohort_key(topology_epoch=0, **{**base, "ep": 2})


def _section(title: str) -> str:
    start = DOC.index(f"\n## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def test_trace_id_rule_test_vectors_in_the_document() -> None:
    """The documented hash inputs and test vectors are what both sides compute."""
    import hashlib

    assert hashlib.sha256(b"otel-straggler/trace/job-1/7").digest()[:16] == s.trace_id_for_step(
        "job-1", 7).to_bytes(16, "big")
    block0 = s.trace_id_for_step("job-1", 7)
    block2 = s.trace_id_for_step("job-1", 7, block=2)
    assert hashlib.sha256(b"otel-straggler/trace/job-1/7/block/2").digest()[:16] == block2.to_bytes(16, "big")
    assert hashlib.sha256(f"otel-straggler/job-step/{block2:032x}".encode()).digest()[:8] == s.job_step_span_id(
        "job-1", 7, block=2).to_bytes(8, "big")
    vectors = {
        block0.to_bytes(16, "big").hex(): "trace id",
        s.job_step_span_id("job-1", 7).to_bytes(8, "big").hex(): "train-step",
        s.rank_step_span_id("job-1", 7, 3).to_bytes(8, "big").hex(): "rank-step",
        block2.to_bytes(16, "big").hex(): "block 2's trace id",
        s.job_step_span_id("job-1", 7, block=2).to_bytes(8, "big").hex(): "block 2's train-step",
    }
    for hexid in vectors:
        assert f"`{hexid}`" in DOC, vectors[hexid]
    for text in ("`otel-straggler/trace/J/N`", "`otel-straggler/trace/J/N/block/B`", "`otel-straggler/job-step/T`",
                 "`otel-straggler/rank-step/J/N/R`"):
        assert text in DOC


def test_a_step_trace_holds_one_block_of_64_ranks() -> None:
    assert s.STEP_TRACE_RANKS == 64
    assert [s.trace_block(r) for r in (0, 63, 64, 127, 128, 8191)] == [0, 0, 1, 1, 2, 127]
    assert s.trace_id_for_step("j", 3, block=0) == s.trace_id_for_step("j", 3)
    assert len({s.trace_id_for_step("j", 3, block=b) for b in range(128)}) == 128
    assert s.job_step_span_id("j", 3, "u", 5) == s.step_root_span_id(s.trace_id_for_step("j", 3, "u", 5))


def test_stage_group_table_is_the_emitters_mapping() -> None:
    """Every timer name in the document's stage-group table maps to that group, and every name of the mapping
    is in the table."""
    from otel_straggler_schema.stages import STAGE_GROUP_BY_NAME, stage_group

    table: dict[str, str] = {}
    for names, group in re.findall(r"^\| (`[a-z0-9-]+`(?:, `[a-z0-9-]+`)*) \| `([a-z0-9-]+)` \|$",
                                   _section("Stage groups"), flags=re.M):
        for name in re.findall(r"`([a-z0-9-]+)`", names):
            table[name] = group
    assert table == STAGE_GROUP_BY_NAME
    assert set(STAGE_GROUP_BY_NAME.values()) <= set(s.STAGE_GROUPS)
    assert all(stage_group(n) == g for n, g in table.items())
    assert stage_group("startup-time") == "setup" and stage_group("train-data-iterators-setup") == "setup"
    uses = _section("Stage groups").split("What the collector does")[1]
    for group in s.STAGE_GROUPS:
        assert f"`{group}`" in uses, group


def test_evidence_fields_are_the_verdict_fields() -> None:
    """The evidence JSONL fields documented are exactly what ``verdict_to_dict`` writes."""
    from collector_processor.processor.straggler.events import verdict_to_dict
    from collector_processor.processor.straggler.model import Verdict

    documented: set[str] = set()
    for cell in re.findall(r"^\| (`[a-z_]+`(?: / `[a-z_]+`)?) \|", _section("Evidence lines (JSONL from the "
                                                                           "collector's `file` exporter)"),
                           flags=re.M):
        documented.update(re.findall(r"`([a-z_]+)`", cell))
    v = Verdict(job="j", cohort="c", rank=1, host="h", gpu="g", stage="forward-compute", group="forward",
                verdict=s.VERDICT_STRAGGLER, reason="persistent_excess", deviation=0.1, value_ms=11.0,
                reference_rank=None, reference_ms=10.0, measurement=s.MEASUREMENT_DEVICE, window_start=10,
                window_end=14, step=14, attribution=s.ATTRIBUTION_GPU, step_time_lost_ms=1.0,
                gpu_seconds_per_hour=2.0, cohort_size=8, collective_evidence="", trace_id=b"\x01" * 16)
    assert documented == set(verdict_to_dict(v))


def test_job_token_test_vector_in_the_document() -> None:
    """The documented derivation and its vector are what ``job_token`` computes, and the collector takes it for that
    job alone."""
    import base64
    import hashlib
    import hmac

    secret, job = "0123456789abcdef0123456789abcdef", "job-1"
    token = s.job_token(secret, job)
    mac = hmac.new(secret.encode(), b"otel-straggler/job-token/job-1", hashlib.sha256).hexdigest()
    assert token == f"j1.{base64.urlsafe_b64encode(job.encode()).decode().rstrip('=')}.{mac}"
    assert f"`{token}`" in DOC and "`otel-straggler/job-token/`" in DOC
    assert s.job_token_parts(token) == (job, mac)
    assert s.job_token_parts(token.replace("j1.", "j2.")) is None
    for bad_secret, bad_job in (("short", job), (secret, ""), (secret, "x" * (s.JOB_ID_MAX_BYTES + 1))):
        with pytest.raises(ValueError):
            s.job_token(bad_secret, bad_job)
