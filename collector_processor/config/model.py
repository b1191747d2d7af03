"""The ``service`` section: pipelines and the collector's own telemetry."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from collector_processor.config.types import Strict, is_loopback, split_host_port

SIGNALS = ("traces", "metrics", "logs")
MIB = 1024 * 1024


class QueueConfig(Strict):
    """Bounded queue between a pipeline's receivers and its worker thread (extension of the upstream schema)."""

    max_items: int = Field(1024, ge=1, le=1_000_000)
    max_bytes_mib: float = Field(256, gt=0, le=1024 * 1024)


class PipelineConfig(Strict):
    receivers: list[str] = Field(min_length=1)
    processors: list[str] = Field(default_factory=list)
    exporters: list[str] = Field(min_length=1)
    queue: QueueConfig = Field(default_factory=QueueConfig)


class TelemetryMetrics(Strict):
    # Where the collector's own /metrics is served. Empty: served by the ``prometheus`` exporter of the config
    # (the shared registry holds both), or nowhere if there is none.
    address: str = ""
    # it serves no token: beyond loopback only with this explicit opt-in
    allow_unauthenticated: bool = False

    @model_validator(mode="after")
    def _guarded(self) -> TelemetryMetrics:
        if self.address.strip() and not self.allow_unauthenticated:
            host, _port = split_host_port(self.address.strip(), 9464)
            if not is_loopback(host):
                raise ValueError(f"address {self.address!r} is beyond loopback and serves no token: bind "
                                 "loopback, serve it through a prometheus exporter with auth, or set "
                                 "allow_unauthenticated: true")
        return self


class TelemetryConfig(Strict):
    metrics: TelemetryMetrics = Field(default_factory=TelemetryMetrics)


class ServiceConfig(Strict):
    pipelines: dict[str, PipelineConfig] = Field(min_length=1)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    shutdown_timeout: float = Field(10.0, gt=0, le=3600.0)  # seconds for the whole drain on SIGTERM

    @field_validator("pipelines")
    @classmethod
    def _signals(cls, v: dict[str, PipelineConfig]) -> dict[str, PipelineConfig]:
        for pid in v:
            sig = pid.split("/", 1)[0]
            if sig not in SIGNALS:
                raise ValueError(f"pipeline id {pid!r}: signal must be one of {', '.join(SIGNALS)}")
        return v

    def used_ids(self) -> set[str]:
        """Every component id that some pipeline lists."""
        return {x for p in self.pipelines.values() for x in (*p.receivers, *p.processors, *p.exporters)}
