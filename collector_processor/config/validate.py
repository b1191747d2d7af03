"""Turns the merged YAML mapping into validated component configs; every error names the key path and line.

The component types come from a ``Factories`` (by default the distribution's, ``components.default_factories``);
what a factory declares (signals, side output, events) is all the checks below know of a component.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from collector_processor.components import default_factories
from collector_processor.config.loader import ConfigError, Marks
from collector_processor.config.model import ServiceConfig
from collector_processor.registry import Factories, Factory

log = logging.getLogger(__name__)
KINDS = {"receivers": "receiver", "processors": "processor", "exporters": "exporter", "connectors": "connector"}
TOP = {*KINDS, "service"}


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
    connectors: dict[str, Component] = field(default_factory=dict)
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


def _ids(raw: dict[str, Any], section: str) -> dict[str, Any]:
    comps = raw.get(section)
    return comps if isinstance(comps, dict) else {}


def _processor_receivers_as_connectors(raw: dict[str, Any], factories: Factories) -> dict[str, Any]:
    """Accepts the deprecated form in which a ``logs`` pipeline lists a processor (e.g. ``straggler``) among its
    receivers: it becomes a connector of that id, the exporter of every pipeline that lists the processor. Warns
    once with the form to write instead."""
    svc = raw.get("service")
    pipelines = svc.get("pipelines") if isinstance(svc, dict) else None
    if not isinstance(pipelines, dict):
        return raw
    receivers, processors, connectors = _ids(raw, "receivers"), _ids(raw, "processors"), _ids(raw, "connectors")
    moved: dict[str, list[str]] = {}  # processor id -> the logs pipelines that list it as a receiver
    for pid, p in pipelines.items():
        if not (isinstance(p, dict) and isinstance(p.get("receivers"), list) and str(pid).startswith("logs")):
            continue
        for rid in p["receivers"]:
            if (isinstance(rid, str) and rid in processors and rid not in receivers and rid not in connectors
                    and factories.lookup("connector", rid) is not None):
                moved.setdefault(rid, []).append(pid)
    if not moved:
        return raw
    raw = copy.deepcopy(raw)
    raw.setdefault("connectors", {})
    if not isinstance(raw["connectors"], dict):
        return raw
    upstream: dict[str, list[str]] = {}
    for cid in moved:
        raw["connectors"][cid] = {}
        for pid, p in raw["service"]["pipelines"].items():
            if isinstance(p, dict) and cid in (p.get("processors") or []) and isinstance(p.get("exporters"), list):
                if cid not in p["exporters"]:
                    p["exporters"].append(cid)
                upstream.setdefault(cid, []).append(pid)
    lines = ["connectors:"] + [f"  {cid}: {{}}" for cid in moved] + ["service:", "  pipelines:"]
    for cid in moved:
        for pid in upstream.get(cid, []):
            exps = ", ".join(raw["service"]["pipelines"][pid]["exporters"])
            lines.append(f"    {pid}: {{processors: [..., {cid}], exporters: [{exps}]}}")
        for pid in moved[cid]:
            lines.append(f"    {pid}: {{receivers: [{cid}], ...}}")
    log.warning("deprecated: a processor listed as the receiver of a logs pipeline (%s); declare it as a connector, "
                "the exporter of the pipeline that runs the processor and the receiver of the logs pipeline:\n%s",
                ", ".join(f"{pid} <- {cid}" for cid, pids in moved.items() for pid in pids), "\n".join(lines))
    return raw


def validate(raw: dict[str, Any], marks: Marks | None = None, factories: Factories | None = None) -> CollectorConfig:
    """Raise ``ConfigError`` listing every problem found (not just the first)."""
    marks = marks or Marks()
    factories = factories or default_factories()
    raw = _processor_receivers_as_connectors(raw, factories)
    errors: list[str] = []
    cfg = CollectorConfig()
    for key in raw:
        if key not in TOP:
            hint = " (extensions are not supported)" if key == "extensions" else ""
            errors.append(_fmt((key,), f"unknown top-level section{hint}", marks))
    for section, kind in KINDS.items():
        comps = raw.get(section) or {}
        if not isinstance(comps, dict):
            errors.append(_fmt((section,), "must be a mapping of component ids", marks))
            continue
        for cid, body in comps.items():
            fac = factories.lookup(kind, cid)
            if fac is None:
                errors.append(_fmt((section, cid), f"unknown {kind} type {cid.split('/', 1)[0]!r} "
                                   f"(known: {', '.join(factories.known_types(kind))})", marks))
                continue
            if "/" in cid and not cid.split("/", 1)[1]:
                errors.append(_fmt((section, cid), "empty name after '/'", marks))
                continue
            if body is None:
                body = {}
            if not isinstance(body, dict):
                errors.append(_fmt((section, cid), "must be a mapping", marks))
                continue
            try:
                conf = fac.config.model_validate(body)
            except ValidationError as e:
                errors.extend(_pydantic(e, (section, cid), marks))
                continue
            getattr(cfg, section)[cid] = Component(cid, fac, conf)
    for cid in _ids(raw, "connectors"):
        for section in ("receivers", "exporters"):
            if cid in _ids(raw, section):
                errors.append(_fmt(("connectors", cid), f"{cid!r} is both a connector and one of the {section}; "
                                   "a pipeline could not tell which is meant", marks))
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


def _member(cfg: CollectorConfig, raw: dict[str, Any], errors: list[str], marks: Marks, section: str, cid: str,
            sig: str, where: tuple[Any, ...]) -> Component | None:
    """The component a pipeline lists under ``section`` (a connector too, for receivers and exporters), reporting
    one that is undefined (unless it was already reported as invalid) or does not support the pipeline's signal."""
    kind = KINDS[section]
    comp = getattr(cfg, section).get(cid)
    if comp is None and section != "processors":
        conn = cfg.connectors.get(cid)
        if conn is not None:
            ok = sig in (conn.factory.outputs if section == "receivers" else conn.factory.signals)
            if not ok:
                side = "feed" if section == "receivers" else "take"
                errors.append(_fmt(where, f"connector {cid!r} cannot {side} {sig} pipelines", marks))
            return conn
    if comp is None:
        if cid not in _ids(raw, section) and cid not in _ids(raw, "connectors"):
            errors.append(_fmt(where, f"{kind} {cid!r} is not defined under {section}", marks))
    elif sig not in comp.factory.signals:
        errors.append(_fmt(where, f"{kind} {cid!r} does not support {sig}", marks))
    return comp


def _check_pipelines(raw: dict[str, Any], cfg: CollectorConfig, marks: Marks) -> list[str]:
    assert cfg.service is not None
    errors: list[str] = []
    as_exporter: dict[str, list[str]] = {}  # connector id -> pipelines it is the exporter of
    as_receiver: dict[str, list[str]] = {}
    for pid, p in cfg.service.pipelines.items():
        sig = pid.split("/", 1)[0]
        base = ("service", "pipelines", pid)
        for i, rid in enumerate(p.receivers):
            comp = _member(cfg, raw, errors, marks, "receivers", rid, sig, (*base, "receivers", i))
            if comp is not None and comp.factory.kind == "connector":
                as_receiver.setdefault(rid, []).append(pid)
        for i, xid in enumerate(p.processors):
            _member(cfg, raw, errors, marks, "processors", xid, sig, (*base, "processors", i))
        if len(set(p.processors)) != len(p.processors):
            errors.append(_fmt((*base, "processors"), "a processor is listed twice", marks))
        for i, eid in enumerate(p.exporters):
            where = (*base, "exporters", i)
            comp = _member(cfg, raw, errors, marks, "exporters", eid, sig, where)
            if comp is None:
                continue
            if comp.factory.kind == "connector":
                as_exporter.setdefault(eid, []).append(pid)
                emits = comp.factory.consumes
                if emits and not any(x in cfg.processors and cfg.processors[x].factory.emits == emits
                                     for x in p.processors):
                    errors.append(_fmt(where, f"connector {eid!r} carries the {emits} of a processor of its "
                                       f"pipeline, and {pid} has no processor that emits {emits}", marks))
            elif comp.factory.events_only and sig in comp.factory.signals and not all(
                    r in cfg.connectors for r in p.receivers):
                errors.append(_fmt(where, f"exporter {eid!r} writes events from connectors only; its pipeline's "
                                   "receivers must all be connectors", marks))
    for cid in cfg.connectors:
        if cid in as_exporter and cid not in as_receiver:
            errors.append(_fmt(("connectors", cid), "must be used as both receiver and exporter but is not the "
                               "receiver of any pipeline", marks))
        elif cid in as_receiver and cid not in as_exporter:
            fac = cfg.connectors[cid].factory
            errors.append(_fmt(("connectors", cid), f"{cid} is in no {'/'.join(sorted(fac.signals))} pipeline, so "
                               f"it would never emit {fac.consumes or 'anything'} (a connector must be the exporter "
                               "of a pipeline and the receiver of another)", marks))
    used = cfg.service.used_ids()
    for section in KINDS:
        for cid in getattr(cfg, section):
            if cid not in used:
                log.warning("%s.%s is defined but used by no pipeline", section, cid)
    return errors
