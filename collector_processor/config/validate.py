"""Turns the merged YAML mapping into validated component configs; every error names the key path and line."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from collector_processor.config.loader import ConfigError, Marks
from collector_processor.config.model import ServiceConfig
from collector_processor.registry import Factory, known_types, lookup

log = logging.getLogger(__name__)
KINDS = {"receivers": "receiver", "processors": "processor", "exporters": "exporter"}
TOP = {"receivers", "processors", "exporters", "service"}


@dataclass
class Component:
    id: str
    factory: Factory
    config: BaseModel


@dataclass
class CollectorConfig:
    receivers: dict[str, Component] = field(default_factory=dict)
    processors: dict[str, Component] = field(default_factory=dict)
    exporters: dict[str, Component] = field(default_factory=dict)
    service: ServiceConfig | None = None


def _fmt(path: tuple[Any, ...], msg: str, marks: Marks) -> str:
    where = marks.locate(path)
    dotted = ".".join(str(p) for p in path) or "<root>"
    return f"{dotted}: {msg}" + (f" ({where})" if where else "")


def _pydantic(e: ValidationError, base: tuple[Any, ...], marks: Marks) -> list[str]:
    out = []
    for err in e.errors():
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and x.startswith("function-")))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        out.append(_fmt(base + loc, msg, marks))
    return out


def validate(raw: dict[str, Any], marks: Marks | None = None) -> CollectorConfig:
    """Raise ``ConfigError`` listing every problem found (not just the first)."""
    marks = marks or Marks()
    errors: list[str] = []
    cfg = CollectorConfig()
    for key in raw:
        if key not in TOP:
            hint = " (connectors/extensions are not supported; list the straggler processor as a logs receiver)" \
                if key in ("connectors", "extensions") else ""
            errors.append(_fmt((key,), f"unknown top-level section{hint}", marks))
    for section, kind in KINDS.items():
        comps = raw.get(section) or {}
        if not isinstance(comps, dict):
            errors.append(_fmt((section,), "must be a mapping of component ids", marks))
            continue
        for cid, body in comps.items():
            fac = lookup(kind, cid)
            if fac is None:
                errors.append(_fmt((section, cid), f"unknown {kind} type {cid.split('/', 1)[0]!r} "
                                   f"(known: {', '.join(known_types(kind))})", marks))
                continue
            if "/" in cid and not cid.split("/", 1)[1]:
                errors.append(_fmt((section, cid), "empty name after '/'", marks))
                continue
            try:
                model = fac.config_model()
            except ImportError as e:
                errors.append(_fmt((section, cid), f"component type not available: {e}", marks))
                continue
            if body is None:
                body = {}
            if not isinstance(body, dict):
                errors.append(_fmt((section, cid), "must be a mapping", marks))
                continue
            try:
                conf = model.model_validate(body)
            except ValidationError as e:
                errors.extend(_pydantic(e, (section, cid), marks))
                continue
            getattr(cfg, section)[cid] = Component(cid, fac, conf)
    svc = raw.get("service")
    if not isinstance(svc, dict):
        errors.append(_fmt(("service",), "missing or not a mapping (service.pipelines is required)", marks))
    else:
        try:
            cfg.service = ServiceConfig.model_validate(svc)
        except ValidationError as e:
            errors.extend(_pydantic(e, ("service",), marks))
    if cfg.service is not None:
        errors.extend(_check_pipelines(raw, cfg, marks))
    if errors:
        text = "invalid configuration:\n  " + "\n  ".join(errors)
        raise ConfigError(marks.redact(text))
    return cfg


def _member(cfg: CollectorConfig, raw_sections: dict[str, Any], errors: list[str], marks: Marks, section: str,
            cid: str, sig: str, where: tuple[Any, ...]) -> Component | None:
    """The component a pipeline lists under ``section``, reporting one that is undefined (unless it was already
    reported as invalid) or does not support the pipeline's signal."""
    kind = KINDS[section]
    comp = getattr(cfg, section).get(cid)
    if comp is None:
        if cid not in raw_sections[section]:
            errors.append(_fmt(where, f"{kind} {cid!r} is not defined under {section}", marks))
    elif sig not in comp.factory.signals:
        errors.append(_fmt(where, f"{kind} {cid!r} does not support {sig}", marks))
    return comp


def _check_pipelines(raw: dict[str, Any], cfg: CollectorConfig, marks: Marks) -> list[str]:
    assert cfg.service is not None
    errors: list[str] = []
    raw_sections = {s: (raw.get(s) or {}) for s in KINDS}
    verdict_sources_in_traces: set[str] = set()
    for pid, p in cfg.service.pipelines.items():
        sig = pid.split("/", 1)[0]
        base = ("service", "pipelines", pid)
        for i, rid in enumerate(p.receivers):
            where = (*base, "receivers", i)
            if rid in cfg.receivers:
                continue
            proc = cfg.processors.get(rid)
            if proc is not None and proc.factory.verdict_source:
                if sig != "logs":
                    errors.append(_fmt(where, f"{rid} emits verdicts and can only feed logs pipelines", marks))
                continue
            if rid in raw_sections["receivers"] or rid in raw_sections["processors"]:
                continue  # already reported as an invalid component
            errors.append(_fmt(where, f"receiver {rid!r} is not defined under receivers"
                               + (" (nor a verdict-emitting processor)" if sig == "logs" else ""), marks))
        for i, xid in enumerate(p.processors):
            comp = _member(cfg, raw_sections, errors, marks, "processors", xid, sig, (*base, "processors", i))
            if comp is not None and comp.factory.verdict_source:
                verdict_sources_in_traces.add(xid)
        if len(set(p.processors)) != len(p.processors):
            errors.append(_fmt((*base, "processors"), "a processor is listed twice", marks))
        for i, eid in enumerate(p.exporters):
            where = (*base, "exporters", i)
            comp = _member(cfg, raw_sections, errors, marks, "exporters", eid, sig, where)
            if comp is not None and sig in comp.factory.signals and comp.factory.extra.get("verdicts_only") and not all(
                    r in cfg.processors and cfg.processors[r].factory.verdict_source for r in p.receivers):
                errors.append(_fmt(where, f"exporter {eid!r} writes verdicts only; its pipeline's receivers must "
                                   "all be verdict-emitting processors", marks))
    for pid, p in cfg.service.pipelines.items():
        for i, rid in enumerate(p.receivers):
            proc = cfg.processors.get(rid)
            if proc is not None and proc.factory.verdict_source and rid not in verdict_sources_in_traces:
                errors.append(_fmt(("service", "pipelines", pid, "receivers", i),
                                   f"{rid} is in no traces pipeline, so it would never emit verdicts", marks))
    used = cfg.service.used_ids()
    for section in KINDS:
        for cid in getattr(cfg, section):
            if cid not in used:
                log.warning("%s.%s is defined but used by no pipeline", section, cid)
    return errors
