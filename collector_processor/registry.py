"""Component factories, in the OTel Collector's manner: ``kind`` + ``type`` -> config model + constructor.

A factory says what its components take and give (signals, side output, events), so that the configuration can be
checked and the pipelines wired without knowing any component. Which factories a collector has is decided by its
distribution (``collector_processor.components``, otelcol's ``components.go``), not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from collector_processor.component import Emit, Forward
from collector_processor.telemetry import Telemetry

KINDS = ("receiver", "processor", "exporter", "connector")
SIGNALS = frozenset({"traces", "metrics", "logs"})


@dataclass
class BuildContext:
    """What a factory's ``create`` is given besides its id and config. The functions look their targets up when
    called, so a component may be built before the pipelines it feeds."""

    telemetry: Telemetry
    healthy: Callable[[], bool] = lambda: True
    emit_for: Callable[[str], Emit] = lambda _id: lambda _items: None  # processor id -> its side-output emitter
    forward_for: Callable[[str], Forward] = lambda _id: lambda _batch: None  # connector id -> downstream feed
    consumers_for: Callable[[str], Mapping[str, list[Any]]] = lambda _id: {}  # receiver id -> pipelines by signal
    tenant_of: Callable[[str], str] = lambda _job: ""  # job -> its tenant (tenancy.Tenancy of the receivers' auth)


@dataclass(frozen=True)
class Factory:
    kind: str  # one of KINDS
    type: str
    config: type[BaseModel]
    create: Callable[[BuildContext, str, Any], Any]
    # receiver: signals it produces; processor, exporter: signals it takes; connector: signals it takes as the
    # exporter of a pipeline
    signals: frozenset[str] = SIGNALS
    outputs: frozenset[str] = frozenset()  # connector: signals of the pipelines it is a receiver of
    emits: str = ""  # processor: the side output it emits besides its data (e.g. "verdicts")
    consumes: str = ""  # connector: the side output it carries from its upstream pipelines' processors
    events_only: bool = False  # exporter: takes events from connectors only, not OTLP requests
    aliases: tuple[str, ...] = field(default=())  # other type names of the same factory


def component_type(cid: str) -> str:
    return cid.split("/", 1)[0]


class Factories:
    """The factories of one collector build, by kind and type (aliases included)."""

    def __init__(self, factories: Iterable[Factory]) -> None:
        self._by: dict[tuple[str, str], Factory] = {}
        self._names: dict[str, list[str]] = {k: [] for k in KINDS}
        for f in factories:
            if f.kind not in KINDS:
                raise ValueError(f"factory {f.type}: unknown kind {f.kind!r}")
            for name in (f.type, *f.aliases):
                if (f.kind, name) in self._by:
                    raise ValueError(f"two {f.kind} factories named {name!r}")
                self._by[(f.kind, name)] = f
                self._names[f.kind].append(name)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter({id(f): f for f in self._by.values()}.values())

    def lookup(self, kind: str, cid: str) -> Factory | None:
        return self._by.get((kind, component_type(cid)))

    def known_types(self, kind: str) -> list[str]:
        return sorted(self._names[kind])

    def extended(self, *more: Factory) -> Factories:
        """These factories plus ``more`` (a build with extra component types, e.g. in tests)."""
        return Factories([*self, *more])
