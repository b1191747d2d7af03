"""Writes the reference tables of the docs from the code that defines them (``--check``: change nothing, exit 1
when a doc differs from what would be written). Like the OTel Collector's ``metadata.yaml`` -> documentation: a
default, a bound, a metric name or a label is written once, in code, and the docs are generated from it.

Sources:
* emitter settings: ``otel_straggler.config`` (``EmitterConfig`` defaults, ``_PARSERS`` bounds, ``HELP``);
* collector settings: the pydantic models of each component of ``collector_processor.components`` (defaults and
  bounds of every key);
* metrics: ``otel_straggler_schema.COLLECTOR_METRICS`` and ``EMITTER_METRICS`` (name, kind, unit, labels, meaning);
* stage groups: ``otel_straggler_schema.stages`` (Megatron timer name -> group).

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``; the text around
it is written by hand. ``tests/test_generated_docs.py`` runs ``check()``.

Usage: ``python scripts/gen_docs.py`` (write) or ``python scripts/gen_docs.py --check``.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN = "<!-- generated: {name} (scripts/gen_docs.py; edit the source, then run it) -->"
END = "<!-- end generated: {name} -->"


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | tuple):
        return ", ".join(_fmt(v) for v in value) if value else "[]"
    if value is None:
        return "none"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(*cells: str) -> str:
    """A table row; an empty cell is written ``| |``."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


# --- emitter -----------------------------------------------------------------------------------------------------
def emitter_settings() -> str:
    from otel_straggler import config

    rows = ["| variable | default | allowed | meaning |", "|---|---|---|---|"]
    for name, parser in config._PARSERS.items():
        default = config._DEFAULTS[name]
        shown = "auto" if name == "device_every" and default == 0 else _fmt(default)
        rows.append(f"| `{config.ENV_PREFIX}{name.upper()}` | `{shown}` | {_cell(parser.allowed)} | "
                    f"{_cell(config.HELP[name])} |")
    return "\n".join(rows)


# --- collector (pydantic models) ---------------------------------------------------------------------------------
def _model_of(annotation: Any) -> type | None:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def _bounds(field: Any) -> str:
    parts: list[str] = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {_fmt(value)}")
    annotation = field.annotation
    if typing.get_origin(annotation) is Literal:
        parts.append(", ".join(_fmt(a) for a in typing.get_args(annotation)))
    return ", ".join(parts)


def _default(field: Any) -> Any:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        return field.default_factory()
    return None if field.default is PydanticUndefined else field.default


def _walk(model: type, prefix: str, default_obj: Any) -> list[tuple[str, str, str]]:
    from pydantic import BaseModel

    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(default_obj, name, None) if default_obj is not None else _default(field)
        sub = _model_of(field.annotation)
        if sub is not None:
            rows += _walk(sub, f"{key}.", value if isinstance(value, BaseModel) else None)
            continue
        if field.is_required() and default_obj is None:
            shown = "required"
        elif isinstance(value, BaseModel):
            shown = "{}"
        else:
            shown = _fmt(value)
        rows.append((key, shown, _bounds(field)))
    return rows


def _component_table(model: type) -> str:
    rows = ["| key | default | allowed |", "|---|---|---|"]
    for key, default, bounds in _walk(model, "", None):
        rows.append(_row(f"`{key}`", f"`{_cell(default)}`", _cell(bounds)))
    return "\n".join(rows)


def _shared_words(types: list[str]) -> list[str]:
    """The leading ``_``-separated words every one of ``types`` has."""
    shared = []
    for words in zip(*(t.split("_") for t in types)):
        if len(set(words)) > 1:
            break
        shared.append(words[0])
    return shared


def _collector_models() -> dict[str, type]:
    """Block name -> config model: ``collector-<kind>-<type>`` for each factory of the distribution
    (``collector_processor.components``), one block for factories that share a model (``otlp_grpc`` and
    ``otlp_http``: ``otlp``, the start of the types they share), and ``collector-service``."""
    from collector_processor.components import factories
    from collector_processor.config.model import ServiceConfig

    types: dict[tuple[str, type], list[str]] = {}
    for f in factories():
        types.setdefault((f.kind, f.config), []).append(f.type)
    models: dict[str, type] = {}
    for (kind, model), names in types.items():
        models[f"collector-{kind}-{'-'.join(_shared_words(names))}"] = model
    models["collector-service"] = ServiceConfig
    return models


# --- metrics (the contract) --------------------------------------------------------------------------------------
def collector_metrics() -> str:
    import otel_straggler_schema as s

    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in s.COLLECTOR_METRICS:
        rows.append(_row(f"`{m.name}`", m.kind, ", ".join(m.labels), _cell(m.meaning)))
    return "\n".join(rows)


def emitter_metrics() -> str:
    import otel_straggler_schema as s

    rows = ["| instrument | kind | unit | attributes | meaning |", "|---|---|---|---|---|"]
    for m in s.EMITTER_METRICS:
        rows.append(_row(f"`{m.name}`", m.kind, f"`{m.unit}`", ", ".join(m.labels), _cell(m.meaning)))
    return "\n".join(rows)


def stage_groups() -> str:
    """The timer names of each group (in the schema's order), the name rules, and ``other``."""
    from otel_straggler_schema import stages

    names: dict[str, list[str]] = {}
    for name, group in stages.STAGE_GROUP_BY_NAME.items():
        names.setdefault(group, []).append(f"`{name}`")
    rows = ["| timer name | group |", "|---|---|"]
    rows += [_row(", ".join(n), f"`{group}`") for group, n in names.items()]
    rules: dict[str, list[str]] = {}
    for prefix, group in stages.PREFIX_RULES:
        rules.setdefault(group, []).append(f"starting `{prefix}`")
    for suffix, group in stages.SUFFIX_RULES:
        rules.setdefault(group, []).append(f"ending `{suffix}`")
    rows += [_row(f"a name {' or '.join(r)}, with more before / after it", f"`{group}`") for group, r in rules.items()]
    rows.append(_row("any other name (never guessed from a similar one)", "`other`"))
    return "\n".join(rows)


def emitter_counters() -> str:
    """Each key of the training process's counters (``counters.SNAPSHOT_KEYS``), the thread that writes it, and the
    self-metric it reaches: found by collecting the self-metrics (``export/selfmetrics.py``) over a whole snapshot
    whose only non-zero value is that key's."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_straggler.counters import SNAPSHOT_KEYS, TRAINING_KEYS
    from otel_straggler.export.selfmetrics import SelfMetrics, normalize

    rows = ["| counter key | written by | exported as |", "|---|---|---|"]
    for key in SNAPSHOT_KEYS:
        marker = 7_000_007
        reader = InMemoryMetricReader()
        snap = normalize({k: marker if k == key else 0 for k in SNAPSHOT_KEYS})
        SelfMetrics(MeterProvider(metric_readers=[reader]).get_meter("docs"), lambda snap=snap: snap)
        found = []
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for dp in m.data.data_points:
                        if dp.value in (marker, marker / 1000.0):  # readout_lag_ms is exported in seconds
                            attrs = ",".join(f"{k}={v}" for k, v in dp.attributes.items())
                            found.append(f"`{m.name}`" + (f"{{{attrs}}}" if attrs else ""))
        writer = ("training thread" if key in TRAINING_KEYS else "configuration" if key == "faults_config_error"
                  else "the sum of the `faults_<where>` keys" if key == "faults" else "readout thread")
        rows.append(_row(f"`{key}`", writer, ", ".join(found) or "not exported"))
    return "\n".join(rows)


def blocks() -> dict[str, dict[str, Callable[[], str]]]:
    """doc path -> block name -> its generator."""
    collector = {name: (lambda model=model: _component_table(model)) for name, model in _collector_models().items()}
    return {
        "docs/configuration.md": {"emitter-settings": emitter_settings, **collector},
        "docs/schema.md": {"stage-groups": stage_groups, "collector-metrics": collector_metrics,
                           "emitter-metrics": emitter_metrics, "emitter-counters": emitter_counters},
    }


def render(path: str, text: str) -> str:
    """``text`` with every generated block of ``path`` rewritten; a block the doc lacks is an error."""
    for name, make in blocks()[path].items():
        begin, end = BEGIN.format(name=name), END.format(name=name)
        pattern = re.compile(re.escape(begin) + r"\n(?:.*?\n)?" + re.escape(end), flags=re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path}: no block {name!r} (add the two marker lines where it belongs)")
        text = pattern.sub(lambda _m, b=begin, e=end, make=make: f"{b}\n{make()}\n{e}", text)
    return text


def check() -> list[str]:
    """Docs whose generated blocks differ from what ``write`` would produce."""
    stale = []
    for path in blocks():
        text = (ROOT / path).read_text(encoding="utf-8")
        if render(path, text) != text:
            stale.append(path)
    return stale


def write() -> list[str]:
    changed = []
    for path in blocks():
        file = ROOT / path
        text = file.read_text(encoding="utf-8")
        new = render(path, text)
        if new != text:
            file.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gen_docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a doc is out of date")
    args = ap.parse_args(argv)
    if args.check:
        stale = check()
        for path in stale:
            print(f"{path}: out of date; run python scripts/gen_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
