"""The contract between the emitting side and the collector: ``otel_straggler_schema``.

Every span, event and metric name the project uses lives here and only here, with the attribute keys, the
reason codes, the id rules (trace and span ids of a step, cohort and run keys) and the schema version;
``docs/schema.md`` describes each one (type, unit, meaning) and ``tests/schema`` checks that both sides
honour them. ``otel_straggler_schema.stages`` maps Megatron timer names to stage groups.

A package of its own, importing nothing but the standard library: the emitter (``otel_straggler``) and the
collector (``collector_processor``) both import it, and neither loads the other
(``tests/packaging/test_two_installs.py``). ``otel_straggler.schema`` re-exports it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Final, NamedTuple

SCHEMA_VERSION: Final = "3"  # 3: a step trace per block of STEP_TRACE_RANKS ranks; 2: step summary, step scope

# --- instrumentation scope and span names -------------------------------------------------------
SCOPE_NAME: Final = "otel-straggler"  # stage spans
SCOPE_STEP_NAME: Final = "otel-straggler.step"  # the train-step and rank-step spans
SPAN_JOB_STEP: Final = "train-step"  # one per step and rank block, emitted by its first rank; root of its trace
SPAN_RANK_STEP: Final = "rank-step"  # one per step per rank, parent of that rank's stage spans
# A stage span is named after its Megatron timer name (``forward-compute``) and carries ATTR_STAGE.
SPAN_VERDICT: Final = "straggler.verdict"  # injected by the collector into the step's trace
SERVICE_COLLECTOR: Final = "otel-straggler-collector"  # service.name of the spans the collector itself emits

# --- resource attributes (identity of one training process) -------------------------------------
RES_SERVICE_NAME: Final = "service.name"
RES_HOST_NAME: Final = "host.name"
RES_PROCESS_PID: Final = "process.pid"
RES_RANK: Final = "dl.rank"
RES_WORLD_SIZE: Final = "dl.world_size"
RES_LOCAL_RANK: Final = "dl.local_rank"
RES_TP_RANK: Final = "dl.tensor_parallel.rank"
RES_TP_SIZE: Final = "dl.tensor_parallel.size"
RES_PP_RANK: Final = "dl.pipeline_parallel.rank"
RES_PP_SIZE: Final = "dl.pipeline_parallel.size"
RES_VPP_RANK: Final = "dl.virtual_pipeline_parallel.rank"
RES_VPP_SIZE: Final = "dl.virtual_pipeline_parallel.size"
RES_CP_RANK: Final = "dl.context_parallel.rank"
RES_CP_SIZE: Final = "dl.context_parallel.size"
RES_EP_RANK: Final = "dl.expert_parallel.rank"
RES_EP_SIZE: Final = "dl.expert_parallel.size"
RES_ETP_RANK: Final = "dl.expert_tensor_parallel.rank"
RES_ETP_SIZE: Final = "dl.expert_tensor_parallel.size"
RES_DP_RANK: Final = "dl.data_parallel.rank"
RES_DP_SIZE: Final = "dl.data_parallel.size"
RES_MODEL_CHUNK: Final = "dl.model_chunk"
RES_JOB_ID: Final = "straggler.job.id"
# one launch of the job: a re-run under the same job id is a new run (its own windows and trace ids)
RES_RUN_ID: Final = "straggler.run.id"
RES_GPU_UUID: Final = "straggler.gpu.uuid"
RES_GPU_PCI_BUS_ID: Final = "straggler.gpu.pci_bus_id"
RES_GPU_INDEX: Final = "straggler.gpu.index"
RES_COHORT_KEY: Final = "straggler.cohort.key"
RES_TOPOLOGY_EPOCH: Final = "straggler.topology.epoch"
RES_STAGE_SCHEMA: Final = "straggler.stage_schema"
RES_SCHEMA_VERSION: Final = "straggler.schema.version"
RES_HOT_PATH: Final = "straggler.emitter.hot_path"  # native | python: which start/stop the process runs (hot_path.py)
RES_STEP_SUMMARY: Final = "straggler.step_summary"  # bool: rank-step spans carry the ATTR_SUMMARY_* arrays

# Resource attributes that say whose a span is (tenant, job, run, rank, cohort, node, GPU). A resource naming one of
# them twice is refused as a whole: no two readers (the tenant check, the processor, a gateway routing by the cohort
# key) can ever resolve it differently.
RES_IDENTITY_KEYS: Final = (RES_SERVICE_NAME, RES_JOB_ID, RES_RUN_ID, RES_RANK, RES_WORLD_SIZE, RES_DP_RANK,
                            RES_DP_SIZE, RES_COHORT_KEY, RES_HOST_NAME, RES_GPU_UUID, RES_STEP_SUMMARY)

# Parallel dimensions that define a cohort (DP is the compared axis and is excluded).
COHORT_DIMENSIONS: Final = (
    (RES_TP_RANK, RES_TP_SIZE),
    (RES_PP_RANK, RES_PP_SIZE),
    (RES_VPP_RANK, RES_VPP_SIZE),
    (RES_CP_RANK, RES_CP_SIZE),
    (RES_EP_RANK, RES_EP_SIZE),
    (RES_ETP_RANK, RES_ETP_SIZE),
)

# --- span attributes ----------------------------------------------------------------------------
ATTR_ITERATION: Final = "dl.iteration"  # int, the training step the interval belongs to
ATTR_MICROBATCH_ID: Final = "dl.microbatch_id"  # int, interval detail only
ATTR_STAGE: Final = "straggler.stage"  # str, the Megatron timer name
ATTR_STAGE_GROUP: Final = "straggler.stage.group"  # str, one of STAGE_GROUPS
ATTR_STAGE_LEVEL: Final = "straggler.stage.level"  # int, Megatron log level 0..2
ATTR_DEVICE_MS: Final = "straggler.duration.device_ms"  # double, ms of GPU stream time (absent if none)
ATTR_HOST_MS: Final = "straggler.duration.host_ms"  # double, ms of host wall time
# int, step detail: the repeats whose device time was measured when fewer than straggler.count (device_ms is then
# their sum x count / this); absent when every repeat was
ATTR_DEVICE_REPEATS: Final = "straggler.duration.device_repeats"
ATTR_MEASUREMENT: Final = "straggler.measurement"  # str, MEASUREMENT_DEVICE or MEASUREMENT_HOST_ONLY
ATTR_DEGRADED_REASON: Final = "straggler.degraded.reason"  # str, why device time is absent
ATTR_COUNT: Final = "straggler.count"  # int, intervals aggregated into this span (microbatch repeats)
ATTR_DETAIL: Final = "straggler.detail"  # str, DETAIL_STEP or DETAIL_INTERVAL
ATTR_WORKLOAD_TOKENS: Final = "straggler.workload.tokens"  # int, tokens this rank processed in the step
ATTR_WORKLOAD_SEQUENCES: Final = "straggler.workload.sequences"  # int
ATTR_WORKLOAD_MICROBATCHES: Final = "straggler.workload.microbatches"  # int
ATTR_INJECTED: Final = "straggler.injected"  # bool, test-only slowdown was applied inside this interval
# bool, present and true on a stage span whose interval contains a wait in a collective (stage(..., collective=True))
ATTR_STAGE_COLLECTIVE: Final = "straggler.stage.collective"
# int, on a train-step root: the block of STEP_TRACE_RANKS consecutive ranks whose step trace it roots
ATTR_TRACE_BLOCK: Final = "straggler.trace.block"
# Step summary on the rank-step span: one entry per timer of the step, parallel arrays (same length).
ATTR_SUMMARY_STAGES: Final = "straggler.summary.stages"  # str[], timer names
ATTR_SUMMARY_GROUPS: Final = "straggler.summary.groups"  # str[], stage groups
ATTR_SUMMARY_DEVICE_MS: Final = "straggler.summary.device_ms"  # double[], summed device ms; -1 = not measured
ATTR_SUMMARY_HOST_MS: Final = "straggler.summary.host_ms"  # double[], summed host ms
ATTR_SUMMARY_COUNTS: Final = "straggler.summary.counts"  # int[], intervals aggregated per entry
# str[], the summary's timer names marked collective (ATTR_STAGE_COLLECTIVE); absent when none is
# NVML cause hints on a rank-step (otel_straggler/nvml.py; only with OTEL_STRAGGLER_NVML_INTERVAL_S > 0): the latest
# sample of the rank's GPU
ATTR_GPU_SM_CLOCK_MHZ: Final = "straggler.gpu.sm_clock_mhz"  # int
ATTR_GPU_SM_CLOCK_MAX_MHZ: Final = "straggler.gpu.sm_clock_max_mhz"  # int
ATTR_GPU_CLOCK_REASONS: Final = "straggler.gpu.clocks_event_reasons"  # str[], e.g. sw_thermal_slowdown
ATTR_GPU_TEMPERATURE_C: Final = "straggler.gpu.temperature_c"  # int
ATTR_GPU_POWER_W: Final = "straggler.gpu.power_w"  # double
ATTR_GPU_PCIE_REPLAYS: Final = "straggler.gpu.pcie_replay_errors"  # int, cumulative
ATTR_GPU_NVLINK_ERRORS: Final = "straggler.gpu.nvlink_errors"  # int, cumulative, summed over links
ATTR_SUMMARY_COLLECTIVE: Final = "straggler.summary.collective"
SUMMARY_NOT_MEASURED: Final = -1.0

MEASUREMENT_DEVICE: Final = "device"
MEASUREMENT_HOST_ONLY: Final = "host_only"
DETAIL_STEP: Final = "step"
DETAIL_INTERVAL: Final = "interval"

DEGRADED_REASONS: Final = (
    "no_cuda",  # CPU-only process: host timing by design
    # device timing not sampled on this step (OTEL_STRAGGLER_DEVICE_EVERY), or on this repeat of the step
    # (OTEL_STRAGGLER_DEVICE_REPEATS: another microbatch of the timer carries the step's device time)
    "sampled_out",
    "pool_exhausted",  # every pre-created event was in flight
    "readout_timeout",  # the end event did not complete within the readout timeout
    "cuda_error",  # recording or reading an event raised
    "unbalanced",  # stop without start, or a stop of another start's stream
)

STAGE_GROUPS: Final = (
    "forward",
    "backward",
    "optimizer",
    "grad-sync",
    "param-gather",
    "p2p",
    "data",
    "checkpoint",
    "eval",
    "setup",
    "step",
    "other",
)
# Groups whose time is mostly waiting for peers in a collective: a straggler waits least there.
COLLECTIVE_GROUPS: Final = ("grad-sync", "param-gather", "p2p")

# --- events (OTel log records emitted by the collector) -----------------------------------------
EVENT_NAME_ATTR: Final = "event.name"
EVENT_VERDICT: Final = "straggler.verdict"

EV_JOB: Final = "straggler.job.id"
EV_COHORT: Final = "straggler.cohort.key"
EV_RANK: Final = "dl.rank"
EV_HOST: Final = "host.name"
EV_GPU: Final = "straggler.gpu.uuid"
EV_STAGE: Final = "straggler.stage"
EV_STAGE_GROUP: Final = "straggler.stage.group"
EV_VERDICT: Final = "straggler.verdict"  # str, one of VERDICTS
EV_REASON: Final = "straggler.reason"  # str, one of REASONS
EV_DEVIATION: Final = "straggler.deviation"  # double, (value - reference) / reference
EV_VALUE_MS: Final = "straggler.value_ms"  # double, the rank's window statistic
EV_REFERENCE_RANK: Final = "straggler.reference.rank"  # int
EV_REFERENCE_MS: Final = "straggler.reference.value_ms"  # double
EV_MEASUREMENT: Final = "straggler.measurement"
EV_WINDOW_START: Final = "straggler.window.start_step"  # int
EV_WINDOW_END: Final = "straggler.window.end_step"  # int, inclusive
EV_STEP: Final = "dl.iteration"  # int, the step where the verdict fired
EV_ATTRIBUTION: Final = "straggler.attribution"  # str, one of ATTRIBUTIONS
EV_STEP_TIME_LOST_MS: Final = "straggler.impact.step_time_lost_ms"  # double
EV_GPU_SECONDS_PER_HOUR: Final = "straggler.impact.gpu_seconds_per_hour"  # double
EV_COHORT_SIZE: Final = "straggler.cohort.size"  # int, effective comparable peers incl. the rank
EV_COLLECTIVE_EVIDENCE: Final = "straggler.evidence.collective_wait"  # str, see docs
EV_TRACE_ID: Final = "trace_id"  # hex, the trace of the step where the verdict fired
EV_FIRST_STEP: Final = "straggler.first_step"  # int, the step where the alert was first convicted
EV_FIRST_TRACE_ID: Final = "straggler.first_trace_id"  # hex, that step's trace: the verdict span's and log's
# node verdicts: on a node verdict and on every rank verdict it covers, the host whose node verdict it is
EV_NODE: Final = "straggler.node"  # str, host name
EV_NODE_RANKS: Final = "straggler.node.ranks"  # int[], on a node verdict: the host's ranks convicted together
EV_NODE_GPUS: Final = "straggler.node.gpus"  # str[], on a node verdict: their GPUs
# culprit versus victims (one DP replica's model-parallel ranks slow together): the group's name ("dp3.pp0")
EV_GROUP: Final = "straggler.group"  # str, on culprit, group and victim verdicts
EV_GROUP_RANKS: Final = "straggler.group.ranks"  # int[], on a group verdict: the ranks the timers cannot tell apart
EV_VICTIMS: Final = "straggler.victims"  # int[], on a culprit's verdict: the ranks waiting for it
EV_HINT: Final = "straggler.hint"  # str, on a straggler verdict: its GPU's NVML sample against its peers'
EV_VICTIM_OF: Final = "straggler.victim_of"  # str, on a victim's verdict: "rank:<culprit>" or "group:<name>"
# intermittent_excess verdicts: the median steps between the rank's spike episodes and the episodes in the lookback
EV_PERIOD_STEPS: Final = "straggler.intermittent.period_steps"  # double
EV_EPISODES: Final = "straggler.intermittent.episodes"  # int
# collective_slow events: the ring the time was lost in and, where evidence names one, the member whose links cause it
EV_COLLECTIVE_RING: Final = "straggler.collective.ring"  # str: grad-sync, param-gather, p2p, model-parallel
EV_COLLECTIVE_RANK: Final = "straggler.collective.rank"  # int

VERDICT_STRAGGLER: Final = "straggler"
VERDICT_RECOVERED: Final = "recovered"
VERDICT_UNCERTAIN: Final = "uncertain"
VERDICTS: Final = (VERDICT_STRAGGLER, VERDICT_RECOVERED, VERDICT_UNCERTAIN)

REASONS: Final = (
    "slower_than_reference",  # straggler: beyond tolerance and floor for N consecutive windows
    "persistent_excess",  # straggler: per-step excess over the peers' median summed over 2+ windows
    "within_tolerance",  # recovered: a comparable measurement is back within tolerance
    "below_absolute_floor",  # uncertain: relative gap beyond tolerance but absolute gap under floor
    "workload_incomparable",  # uncertain: the rank's tokens differ from its peers' beyond tolerance
    "cohort_below_min_size",  # uncertain: fewer comparable peers than min_cohort_size
    "missing_samples",  # uncertain: the rank has no usable sample in a window its peers filled
    "recovery_evidence_insufficient",  # uncertain: an active straggler's window was unusable
    "non_finite_sample",  # uncertain: only non-finite or negative samples
    "pair_ambiguous",  # uncertain: a 2-rank cohort differs beyond tolerance and no evidence says which rank is slow
    "collective_wait",  # uncertain: the rank's excess is matched by its reference's excess in another stage (a wait)
    "node_slow",  # straggler (stage NODE_STAGE): most ranks of one host convicted together (a node verdict)
    "group_slow",  # straggler: a model-parallel group slow together, no member's timers name the culprit
    "host_contention",  # uncertain: a host-time excess with every comparable peer on the same host (shared CPU)
    "intermittent_excess",  # straggler: recurring spikes over the peers' per-step median costing a steady straggler's
    "collective_slow",  # uncertain (never pages): a cohort's collective beyond its own baseline (the ring's time lost)
)
NODE_STAGE: Final = "node"  # the stage of a node verdict (one host's ranks slow together)

ATTRIBUTION_GPU: Final = "gpu_stream_stall"
ATTRIBUTION_HOST: Final = "host_only_stall"
ATTRIBUTION_UNKNOWN: Final = "attribution_unknown"
ATTRIBUTIONS: Final = (ATTRIBUTION_GPU, ATTRIBUTION_HOST, ATTRIBUTION_UNKNOWN)

# --- Prometheus metrics exported by the collector -----------------------------------------------
# Labels of the collector's series. The training job's id is ``training_job`` (never ``job`` or ``instance``:
# a scrape with the default ``honor_labels: false`` would rename those ``exported_*``); a label whose value
# would be empty is left out of the series.
L_TRAINING_JOB: Final = "training_job"
L_RUN: Final = "run"  # the launch (straggler.run.id): two runs under one job id are two series
L_FIRST_STEP: Final = "first_step"  # the step where the alert was first convicted
L_TRACE_ID: Final = "trace_id"  # that step's trace id (hex): where its verdict span lives
# on an alert's series whose verdict another verdict explains: "node:<host>" (a node verdict holds on its host)
# or "rank:<culprit>" / "group:<name>" (a victim's: culprit.py); absent on the series that page
# (StragglerDetected selects covered_by="")
L_COVERED_BY: Final = "covered_by"
# Straggler state (labels: training_job, run, cohort, rank, host, gpu, stage, attribution, first_step, trace_id)
M_STRAGGLER_ACTIVE: Final = "otel_straggler_active"  # gauge 1 while a straggler verdict holds, else 0
M_STRAGGLER_DEVIATION: Final = "otel_straggler_deviation_ratio"  # gauge, deviation of the active verdict
M_STEP_TIME_LOST: Final = "otel_straggler_step_time_lost_seconds"  # gauge, per step
M_GPU_LOST_RATIO: Final = "otel_straggler_gpu_lost_ratio"  # gauge, GPU-seconds lost per second of wall time
# GPU-seconds lost by the waiting ranks while alerts held (labels: training_job, run, cohort, rank, host, gpu, stage,
# attribution; exemplar: trace_id of the convicting step)
M_GPU_LOST_SECONDS: Final = "otel_straggler_gpu_lost_seconds_total"
# Verdict counter (labels: training_job, run, verdict, reason; exemplar: trace_id of the verdict's step)
M_VERDICTS: Final = "otel_straggler_verdicts_total"
# Per-rank view for dashboards (labels: training_job, run, cohort, rank, stage_group, measurement), capped
M_RANK_STAGE_SECONDS: Final = "otel_straggler_rank_stage_seconds"  # gauge, last window statistic
M_RANK_DEVIATION: Final = "otel_straggler_rank_deviation_ratio"  # gauge (labels: training_job, run, cohort, rank)
# Wall-clock time (Unix seconds) the collector last accepted a sample of the job (labels: training_job, run); expires
# after series_ttl_s like the per-rank series, so "stopped sending" alerts for that long
M_JOB_LAST_SEEN: Final = "otel_straggler_job_last_seen_timestamp_seconds"
# Time lost per step in a cohort's collective beyond the cohort's own baseline (labels: training_job, run, cohort,
# stage, ring, rank): the collective signal, never paged
M_COLLECTIVE_LOST: Final = "otel_straggler_collective_lost_seconds"
# Collector self-telemetry
M_SPANS_RECEIVED: Final = "otel_straggler_collector_spans_received_total"  # labels: receiver
M_SPANS_ACCEPTED: Final = "otel_straggler_collector_spans_accepted_total"
M_SPANS_REJECTED: Final = "otel_straggler_collector_spans_rejected_total"  # labels: reason
M_SPANS_DROPPED: Final = "otel_straggler_collector_spans_dropped_total"  # labels: reason
M_REQUESTS: Final = "otel_straggler_collector_requests_total"  # labels: receiver, outcome
M_QUEUE_DEPTH: Final = "otel_straggler_collector_queue_depth"  # labels: queue
M_EVICTIONS: Final = "otel_straggler_collector_evictions_total"  # labels: structure
M_WINDOWS_CLOSED: Final = "otel_straggler_collector_windows_closed_total"
M_PROCESSING_SECONDS: Final = "otel_straggler_collector_processing_seconds"  # histogram per batch
M_EXPORT_FAILURES: Final = "otel_straggler_collector_export_failures_total"  # labels: exporter
# items (spans, log records) per OTLP exporter: enqueued = sent + failed + waiting in its sending queue (labels:
# exporter, signal; failed also reason, one of EXPORTER_FAILED_REASONS)
M_EXPORTER_ENQUEUED: Final = "otel_straggler_collector_exporter_enqueued_items_total"
M_EXPORTER_SENT: Final = "otel_straggler_collector_exporter_sent_items_total"
M_EXPORTER_FAILED: Final = "otel_straggler_collector_exporter_failed_items_total"
M_EXPORTER_QUEUED: Final = "otel_straggler_collector_exporter_queued_items"
M_EVIDENCE_LINES: Final = "otel_straggler_collector_evidence_lines_total"
M_UNAUTHENTICATED: Final = "otel_straggler_collector_unauthenticated_total"  # labels: endpoint
# connections (HTTP) and calls (gRPC) ended by the connection budget before a request was read (labels: receiver,
# reason: refused = the budget was full of busy ones, stalled = ended to make room after stall_timeout, shed = HTTP:
# closed before auth to make room for another peer address, peer_limit = HTTP: refused at its address's caps)
M_CONNECTIONS_CLOSED: Final = "otel_straggler_collector_connections_closed_total"
COLLECTOR_CONNECTION_CLOSE_REASONS: Final = ("refused", "stalled", "shed", "peer_limit")
# requests refused because they name a job their token may not write (labels: receiver)
M_TENANT_REFUSED: Final = "otel_straggler_collector_tenant_refused_total"
# requests refused because a resource names an identity attribute (RES_IDENTITY_KEYS) twice
M_DUPLICATE_IDENTITY: Final = "otel_straggler_collector_duplicate_identity_total"
# state of a tenant's jobs evicted to make room, or refused at its share (labels: tenant, structure: cohorts,
# windows, metric_series, queue:<pipeline>, memory)
M_TENANT_EVICTIONS: Final = "otel_straggler_collector_tenant_evictions_total"
# requests a receiver would have processed on its event loop, queued because the pipeline's inline budget was spent
# (labels: pipeline)
M_INLINE_DEFERRED: Final = "otel_straggler_collector_inline_deferred_total"
M_MEMORY_BYTES: Final = "otel_straggler_collector_memory_bytes"
# the largest request body a receiver admits whatever its content while the collector is idle (labels: receiver)
M_ADMITTED_BYTES: Final = "otel_straggler_collector_receiver_admitted_bytes"
M_COMPONENT_ERRORS: Final = "otel_straggler_collector_component_errors_total"  # labels: component
# Label values each collector counter reports from the start (at 0), so a rate sees its first event; the
# receiver / endpoint / exporter / component labels take the ids of the configured components.
# queue_full: the oldest request dropped for a new one; refused: the receiver answered a non-retryable error;
# partial: the receiver took the request and refused these items (partial success); gave_up: retries ran out;
# shutdown: still queued when the collector stopped; error: anything else
EXPORTER_FAILED_REASONS: Final = ("queue_full", "refused", "partial", "gave_up", "shutdown", "error")
COLLECTOR_DROPPED_REASONS: Final = ("queue_full", "memory_limit", "shutting_down", "export_failed", "shutdown")
COLLECTOR_REJECTED_REASONS: Final = ("malformed", "non_finite", "duplicate", "late", "over_cap", "quarantined")
COLLECTOR_REQUEST_OUTCOMES: Final = ("ok", "partial", "invalid", "throttled", "unauthenticated", "too_large",
                                     "aborted", "forbidden")
# Emitter self-metrics re-exported from OTLP metrics the ranks send (labels: training_job, run, rank, reason)
M_EMITTER_PREFIX: Final = "otel_straggler_emitter_"

# --- emitter self-metrics (OTel metric instruments, exported over OTLP by every rank) -----------
SM_INTERVALS: Final = "otel_straggler.emitter.intervals"  # counter, intervals seen
SM_SPANS_EXPORTED: Final = "otel_straggler.emitter.spans.exported"  # counter
SM_DROPPED: Final = "otel_straggler.emitter.dropped"  # counter, attr reason
SM_DEGRADED: Final = "otel_straggler.emitter.degraded"  # counter, attr reason (DEGRADED_REASONS)
SM_BARRIERS_SKIPPED: Final = "otel_straggler.emitter.barriers_skipped"  # counter
SM_POOL_HIGH_WATER: Final = "otel_straggler.emitter.pool.high_water"  # gauge, events in flight (max)
SM_READOUT_LAG: Final = "otel_straggler.emitter.readout.lag"  # gauge, unit s, stop -> readout delay
# gauge: 1 once the rank's export shut down (the job ended normally: otel_straggler.shutdown, atexit, SIGTERM),
# in the last metrics it exports; 0 before. The alert rules resolve a run whose ranks all report it.
SM_ENDED: Final = "otel_straggler.emitter.ended"
SM_FAULTS: Final = "otel_straggler.emitter.faults"  # counter, attr where (exceptions swallowed)
SM_REASON_ATTR: Final = "reason"
SM_STEPS_EVICTED: Final = "otel_straggler.emitter.steps.evicted"  # counter, step aggregates closed early (cap)
SM_SIDECAR_RESTARTS: Final = "otel_straggler.emitter.sidecar.restarts"  # counter, export child restarted
SM_NAMES_TRUNCATED: Final = "otel_straggler.emitter.names.truncated"  # counter, timer names cut to the wire's bound
# Attribute values each counter reports from the start (at 0), so a rate sees its first event.
SM_DROPPED_REASONS: Final = ("ring_full", "pipe_full", "queue_full", "export_failed", "shutdown", "late", "overflow",
                             "sidecar_down")
SM_FAULT_WHERES: Final = ("training", "readout", "config_error", "sink", "export", "metric_export", "span_build",
                          "sidecar", "sidecar_decode", "sidecar_spawn", "sidecar_fatal", "process_sink", "thread_sink")
# Units (UCUM, as OTel metrics carry them): every counter counts items ("1"), the lag is in seconds.
UNIT_COUNT: Final = "1"
UNIT_SECONDS: Final = "s"


class Metric(NamedTuple):
    """One metric the project exports: ``docs/schema.md``'s tables are generated from these (scripts/gen_docs.py),
    and the tests check that the exporters register exactly these names, kinds and labels."""

    name: str
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]  # Prometheus labels (collector) or metric attributes (emitter)
    meaning: str
    unit: str = ""  # emitter instruments: UCUM unit


_STATE_LABELS: Final = ("training_job", "run", "cohort", "rank", "host", "gpu", "stage", "attribution", "first_step",
                        "trace_id", "covered_by")
# Prometheus metrics of the collector (its /metrics), in the order docs/schema.md lists them.
COLLECTOR_METRICS: Final = (
    Metric(M_STRAGGLER_ACTIVE, "gauge", _STATE_LABELS,
           "1 while a `straggler` verdict holds, 0 after `recovered`; `first_step` and `trace_id`: "
           "the step where the alert was first convicted and its trace (hex), fixed for the alert's "
           "life; `covered_by` (empty when none): the verdict that explains this one, `node:<host>`, "
           "`rank:<culprit>` or `group:<name>`; a covered series carries no cost (the covering verdict's does)"),
    Metric(M_STRAGGLER_DEVIATION, "gauge", _STATE_LABELS,
           "deviation of the latest judged window for that series"),
    Metric(M_STEP_TIME_LOST, "gauge", _STATE_LABELS,
           "estimated step time lost per step"),
    Metric(M_GPU_LOST_RATIO, "gauge", _STATE_LABELS,
           "GPU-seconds the waiting ranks lose per second of wall time (2.0: two GPUs' worth of time)"),
    Metric(M_GPU_LOST_SECONDS, "counter",
           ("training_job", "run", "cohort", "rank", "host", "gpu", "stage", "attribution"),
           "GPU-seconds the waiting ranks lost while the alert held (added per judged window); "
           "exemplar `trace_id`: the convicting step's trace"),
    Metric(M_VERDICTS, "counter", ("training_job", "run", "verdict", "reason"),
           "verdicts emitted; exemplar `trace_id`: the latest verdict's trace "
           "(`straggler.first_trace_id`)"),
    Metric(M_RANK_STAGE_SECONDS, "gauge", ("training_job", "run", "cohort", "rank", "stage_group", "measurement"),
           "last window statistic (capped series)"),
    Metric(M_RANK_DEVIATION, "gauge", ("training_job", "run", "cohort", "rank"),
           "worst deviation of the rank over stages in its last windows (capped series)"),
    Metric(M_JOB_LAST_SEEN, "gauge", ("training_job", "run"),
           "Unix time the collector last accepted a sample of the job; the series expires "
           "`metrics.series_ttl_s` after that (`StragglerJobStoppedSending`)"),
    Metric(M_COLLECTIVE_LOST, "gauge", ("training_job", "run", "cohort", "stage", "ring", "rank"),
           "time lost per step in the cohort's collective `stage` beyond the cohort's own baseline (0 within it), "
           "in `ring` (`grad-sync`, `param-gather`, `p2p`, `model-parallel`); `rank`: the member whose links the "
           "evidence names (absent when none); the collective signal, never paged (`collective_slow` events)"),
    Metric(M_SPANS_RECEIVED, "counter", ("receiver",),
           "spans received"),
    Metric(M_SPANS_ACCEPTED, "counter", (),
           "stage samples used by the detector (stage spans, or step-summary entries)"),
    Metric(M_SPANS_REJECTED, "counter", ("reason",),
           "spans rejected (`malformed`, `non_finite`, `duplicate`, `late`, `over_cap`, "
           "`quarantined`); for a step summary, `malformed`/`non_finite` count its bad entries, "
           "`duplicate`/`late` the summary once"),
    Metric(M_SPANS_DROPPED, "counter", ("reason",),
           "spans dropped (`queue_full`, `memory_limit`, `shutting_down`: refused while the collector"
           " stops, `export_failed`, `shutdown`: queued and not processed before the shutdown "
           "deadline)"),
    Metric(M_REQUESTS, "counter", ("receiver", "outcome"),
           "requests by outcome (`ok`, `partial`, `invalid`, `throttled`, `unauthenticated`, "
           "`too_large`, `aborted`: the client went away or stalled past a timeout before the answer,"
           " `forbidden`: a job its token may not write)"),
    Metric(M_QUEUE_DEPTH, "gauge", ("queue",),
           "items waiting per queue"),
    Metric(M_EVICTIONS, "counter", ("structure",),
           "entries evicted from a capped map or window set"),
    Metric(M_WINDOWS_CLOSED, "counter", (),
           "windows judged"),
    Metric(M_PROCESSING_SECONDS, "histogram", (),
           "processing time per request"),
    Metric(M_EXPORT_FAILURES, "counter", ("exporter",),
           "failed exports"),
    Metric(M_EXPORTER_ENQUEUED, "counter", ("exporter", "signal"),
           "items an OTLP exporter took into its sending queue; equals sent + failed + queued"),
    Metric(M_EXPORTER_SENT, "counter", ("exporter", "signal"),
           "items an OTLP exporter delivered (accepted by the receiving end)"),
    Metric(M_EXPORTER_FAILED, "counter", ("exporter", "signal", "reason"),
           "items an OTLP exporter did not deliver, by reason (`queue_full`, `refused`, `partial`, `gave_up`, "
           "`shutdown`, `error`)"),
    Metric(M_EXPORTER_QUEUED, "gauge", ("exporter", "signal"),
           "items in an OTLP exporter's sending queue or being sent"),
    Metric(M_EVIDENCE_LINES, "counter", (),
           "JSONL evidence lines written"),
    Metric(M_UNAUTHENTICATED, "counter", ("endpoint",),
           "requests refused for missing/bad credentials"),
    Metric(M_CONNECTIONS_CLOSED, "counter", ("receiver", "reason"),
           "HTTP connections and gRPC calls ended by the connection budget before a request was read:"
           " `refused` (the budget was full of busy ones), `stalled` (ended to make room after "
           "`stall_timeout` without a request or message), `shed` (HTTP: the oldest connection before auth of "
           "the peer address holding the most, closed to admit one of another), `peer_limit` (HTTP: refused at "
           "its address's `max_connections_per_peer` or `max_preauth_connections_per_peer`)"),
    Metric(M_TENANT_REFUSED, "counter", ("receiver",),
           "requests refused because a resource names a job (`straggler.job.id`) the request's token "
           "may not write (`auth.tenants`), or, sent with a tenant's token, a span outside its own step traces "
           "or posing as the collector's"),
    Metric(M_TENANT_EVICTIONS, "counter", ("tenant", "structure"),
           "cohorts (and their open windows) of a tenant's jobs evicted to make room, by tenant (`auth.tenants` "
           "name; `all-jobs`: jobs no tenant lists; `job-tokens`: jobs with their own token); a tenant holding less "
           "than its share of `max_cohorts` (divided evenly among the tenants holding cohorts) loses none to "
           "another's load; `metric_series`: its jobs' dashboard series refused at its share of `max_series`; "
           "`queue:<pipeline>`, `memory`: its requests refused (retry later) at its share of a queue more than "
           "half full, or of the memory limiter's budget for requests being read and decoded while another "
           "tenant holds or waits for some"),
    Metric(M_DUPLICATE_IDENTITY, "counter", ("receiver",),
           "requests refused (`invalid`) because a resource names an identity attribute (job, run, rank, cohort, "
           "host, GPU, service) more than once"),
    Metric(M_INLINE_DEFERRED, "counter", ("pipeline",),
           "requests a receiver would have processed on its event loop (its pipeline idle) that were queued "
           "instead because the pipeline's budget for that was spent: each item's time beyond 10 ms is charged "
           "to a credit that refills at 0.1 s per second"),
    Metric(M_MEMORY_BYTES, "gauge", (),
           "process RSS seen by the memory limiter"),
    Metric(M_ADMITTED_BYTES, "gauge", ("receiver",),
           "the largest request body the receiver admits whatever it holds while nothing else is being decoded: "
           "the memory limiter's budget over the most a body's bytes and its decoding may take; a larger body "
           "under the size limit is admitted when it decodes in less"),
    Metric(M_COMPONENT_ERRORS, "counter", ("component",),
           "exceptions caught in a processor call or tick (the request was passed on unchanged)"),
    Metric(M_EMITTER_PREFIX + "<name>_total", "counter", ("training_job", "run", "rank", "reason"),
           "emitter self-metric counters received over OTLP, re-exported "
           "(`otel_straggler_emitter_dropped_total`)"),
    Metric(M_EMITTER_PREFIX + "<name>_<unit>", "gauge", ("training_job", "run", "rank", "reason"),
           "emitter self-metric gauges, the unit as a suffix, none for `1` "
           "(`otel_straggler_emitter_readout_lag_seconds`, `otel_straggler_emitter_pool_high_water`)"),
)
# OTel metric instruments every rank exports (its self-metrics), in the order docs/schema.md lists them.
EMITTER_METRICS: Final = (
    Metric(SM_INTERVALS, "counter", (),
           "start/stop intervals completed", UNIT_COUNT),
    Metric(SM_SPANS_EXPORTED, "counter", (),
           "spans handed to the OTLP exporter and exported", UNIT_COUNT),
    Metric(SM_DROPPED, "counter", ("reason",),
           "intervals or spans dropped (`ring_full`, `pipe_full`, `queue_full`, `export_failed`, "
           "`shutdown`, `late`: interval of an already closed step, `overflow`: timers per step cap, "
           "`sidecar_down`: export child dead)", UNIT_COUNT),
    Metric(SM_DEGRADED, "counter", ("reason",),
           "intervals timed host-only, by degraded reason", UNIT_COUNT),
    Metric(SM_BARRIERS_SKIPPED, "counter", (),
           "`barrier=True` calls accepted and not executed", UNIT_COUNT),
    Metric(SM_FAULTS, "counter", ("where",),
           "exceptions caught inside the package and bad settings (training continued): `training`, "
           "`readout`, `config_error`, `sink`, `export`, `metric_export`, `span_build`, `sidecar`, "
           "`sidecar_decode`, `sidecar_spawn`, `sidecar_fatal`, `process_sink`, `thread_sink`", UNIT_COUNT),
    Metric(SM_POOL_HIGH_WATER, "gauge", (),
           "most CUDA events in flight at once", UNIT_COUNT),
    Metric(SM_READOUT_LAG, "gauge", (),
           "delay from stop to readout of the latest interval", UNIT_SECONDS),
    Metric(SM_ENDED, "gauge", (),
           "1 once the rank's export shut down (a normal end), in its last export; 0 before", UNIT_COUNT),
    Metric(SM_STEPS_EVICTED, "counter", (),
           "step aggregates closed early because `max_open_steps` were open", UNIT_COUNT),
    Metric(SM_SIDECAR_RESTARTS, "counter", (),
           "export child process restarted after it died", UNIT_COUNT),
    Metric(SM_NAMES_TRUNCATED, "counter", (),
           "timer names longer than the wire's bound (256 UTF-8 bytes), cut with a hash suffix", UNIT_COUNT),
)



def _ids_of(job_id: str, run_id: str) -> str:
    """The part of every step id that names the launch: the job, and its run when the emitter knows one."""
    return f"{job_id}/run/{run_id}" if run_id else job_id


# A step's spans form one trace per block of this many consecutive global ranks (ranks 0-63 block 0, 64-127 block
# 1, ...): a trace a trace store keeps whole and a UI opens in seconds at any job size (bench/results/
# step-trace-size.md). Block 0's ids are those of a job of at most 64 ranks.
STEP_TRACE_RANKS: Final = 64


def trace_block(rank: int) -> int:
    """The block of ``STEP_TRACE_RANKS`` ranks whose step trace holds ``rank``'s spans."""
    return max(0, int(rank)) // STEP_TRACE_RANKS


def _step_key(job_id: str, run_id: str, step: int, block: int) -> str:
    key = f"{_ids_of(job_id, run_id)}/{int(step)}"
    return f"{key}/block/{int(block)}" if block else key


def trace_id_for_step(job_id: str, step: int, run_id: str = "", block: int = 0) -> int:
    """The 128-bit trace id shared by one step's spans of the ranks of ``block`` (``trace_block(rank)``),
    deterministic in job id, run id, step and block."""
    digest = hashlib.sha256(f"otel-straggler/trace/{_step_key(job_id, run_id, step, block)}".encode()).digest()
    value = int.from_bytes(digest[:16], "big")
    return value or 1


def step_root_span_id(trace_id: int) -> int:
    """Span id of the ``train-step`` root of a step trace, from its trace id alone (so whoever holds a step trace's
    id, a verdict included, can parent a span under its root)."""
    digest = hashlib.sha256(f"otel-straggler/job-step/{int(trace_id):032x}".encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def job_step_span_id(job_id: str, step: int, run_id: str = "", block: int = 0) -> int:
    """Span id of the ``train-step`` root span of ``block``'s step trace (emitted by the block's first rank)."""
    return step_root_span_id(trace_id_for_step(job_id, step, run_id, block))


def rank_step_span_id(job_id: str, step: int, rank: int, run_id: str = "") -> int:
    """Span id of one rank's ``rank-step`` span, parent of its stage spans for that step."""
    key = f"otel-straggler/rank-step/{_ids_of(job_id, run_id)}/{int(step)}/{int(rank)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") or 1


def run_cohort(cohort_key: str, run_id: str) -> str:
    """The collector's key of a cohort within one run, ``<cohort key>@<run id>``: a re-run under the same job id
    gets cohorts (windows, baselines, verdicts) of its own. The cohort key alone without a run id."""
    return f"{cohort_key}@{run_id}" if run_id else cohort_key


def cohort_run(run_cohort_key: str) -> str:
    """The run id in a key made by ``run_cohort`` ('' when it has none)."""
    return run_cohort_key.rpartition("@")[2] if "@" in run_cohort_key else ""


def cohort_key(
    *,
    topology_epoch: int,
    stage_schema: str,
    tp: int = 0,
    pp: int = 0,
    vpp: int = 0,
    cp: int = 0,
    ep: int = 0,
    etp: int = 0,
    chunk: int = 0,
) -> str:
    """Ranks with the same key hold the same role and may be compared; DP is deliberately absent."""
    return f"e{int(topology_epoch)}/{stage_schema}/tp{tp}.pp{pp}.vpp{vpp}.cp{cp}.ep{ep}.etp{etp}.c{chunk}"


# --- per-job credentials --------------------------------------------------------------------------
# A job token lets its holder write one job and no other, without the collector listing jobs: the collector holds
# the cluster's job secret, a launcher that holds it too derives each job's token and hands it to the job's ranks
# (``otel-straggler token``), which send it as ``Authorization: Bearer <token>``. docs/schema.md "Job tokens".
JOB_TOKEN_PREFIX: Final = "j1"
JOB_TOKEN_MAC_INPUT: Final = "otel-straggler/job-token/"  # followed by the job id
JOB_SECRET_MIN_BYTES: Final = 32
JOB_ID_MAX_BYTES: Final = 1024


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def job_token_mac(secret: str | bytes, job_id: str) -> str:
    """HMAC-SHA256 keyed by the job secret (its UTF-8 bytes) over ``otel-straggler/job-token/<job id>``, as 64
    lowercase hex digits."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    return hmac.new(key, f"{JOB_TOKEN_MAC_INPUT}{job_id}".encode(), hashlib.sha256).hexdigest()


def job_token(secret: str | bytes, job_id: str) -> str:
    """The bearer token of job ``job_id`` (its ``straggler.job.id`` exactly): ``j1.<job id as unpadded base64url of
    its UTF-8 bytes>.<job_token_mac>``. The job id travels in the token, so the collector checks the token from the
    request's headers alone, before it reads the body."""
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    if len(key) < JOB_SECRET_MIN_BYTES:
        raise ValueError(f"a job secret of at least {JOB_SECRET_MIN_BYTES} bytes (e.g. openssl rand -hex 32)")
    raw = job_id.encode("utf-8")
    if not raw or len(raw) > JOB_ID_MAX_BYTES:
        raise ValueError(f"a job id of 1 to {JOB_ID_MAX_BYTES} UTF-8 bytes")
    return f"{JOB_TOKEN_PREFIX}.{_b64url(raw)}.{job_token_mac(key, job_id)}"


def job_token_parts(token: str) -> tuple[str, str] | None:
    """(job id, MAC) a token in the form of ``job_token`` states, unverified; None when it is not in that form."""
    prefix, _, rest = token.partition(".")
    encoded, _, mac = rest.partition(".")
    if prefix != JOB_TOKEN_PREFIX or not encoded or len(mac) != 64 or len(encoded) > 2 * JOB_ID_MAX_BYTES:
        return None
    try:
        job = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if not job or _b64url(job.encode("utf-8")) != encoded:  # one spelling per job id
        return None
    return job, mac

