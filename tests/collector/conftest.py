"""Fixtures of the collector service tests (helpers and doubles live in ``service_support``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from service_support import (
    DoubleProcessor,
    GrpcSink,
    HttpSink,
    Running,
    double_factories,
    start_from_yaml,
)

from collector_processor import components
from collector_processor.service import Service


@pytest.fixture(autouse=True)
def double_processor_type(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Adds processor type ``double`` (traces, emits verdicts) and connector type ``double`` (the straggler
    connector's behaviour under another name) to the distribution's factories for the tests of this directory."""
    DoubleProcessor.instances.clear()
    monkeypatch.setattr(components, "_default", components.default_factories().extended(*double_factories()))
    yield


@pytest.fixture
def start_service() -> Iterator[Callable[..., Running]]:
    started: list[Service] = []

    def start(yaml_text: str, env: dict[str, str] | None = None) -> Running:
        run = start_from_yaml(yaml_text, env)
        started.append(run.svc)
        return run

    yield start
    for svc in started:
        svc.shutdown(3.0)


@pytest.fixture
def grpc_sink() -> Iterator[GrpcSink]:
    sink = GrpcSink()
    yield sink
    sink.stop()


@pytest.fixture
def http_sink() -> Iterator[HttpSink]:
    sink = HttpSink()
    yield sink
    sink.stop()
