"""The docs' reference tables are generated from the code (``scripts/gen_docs.py``): a default, a bound or a metric
written in a doc by hand can drift from the code, a generated one cannot. These tests fail when a generated table
differs from what the script would write, when a hand-written table or sentence of any doc states a default the
code does not have, and when an exporter registers a metric other than the contract's table says."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import otel_straggler_schema as s

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
assert _spec and _spec.loader
gen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)

DOCS = [*sorted(ROOT.glob("docs/*.md")), ROOT / "README.md", ROOT / "collector_processor" / "README.md"]
_NUM = r"(-?\d+(?:\.\d+)?)(?![\d.,]*\s?\d{3}\b)"
_UNIT = r"(?:\s?(MiB|KiB|ms)\b)?"  # the code's unit: bytes and seconds, unless the key names its unit
_SCALE = {"MiB": 1024.0**2, "KiB": 1024.0, "ms": 1e-3}


def test_the_generated_tables_are_what_the_code_says() -> None:
    assert gen_docs.check() == [], "run: python scripts/gen_docs.py"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_table_edited_by_hand_fails_the_check() -> None:
    path = "docs/configuration.md"
    text = (ROOT / path).read_text(encoding="utf-8")
    row = "| `max_open_windows` | `64` |"
    assert row in text
    edited = text.replace(row, "| `max_open_windows` | `8` |")
    assert gen_docs.render(path, edited) == text  # the generator writes the code's default back
    with pytest.raises(SystemExit, match="no block 'emitter-settings'"):
        gen_docs.render(path, text.replace("<!-- generated: emitter-settings", "<!-- removed"))


def _defaults() -> dict[str, float]:
    """Numeric defaults by the names the docs use: processor keys (``metrics.*`` too), the other collector
    components' keys whose default is the same wherever the key occurs, and emitter variables."""
    from collector_processor.processor.straggler.config import Config, MetricsConfig
    from otel_straggler import config

    out: dict[str, float] = {}
    for prefix, model in (("", Config), ("metrics.", MetricsConfig)):
        for name, field in model.model_fields.items():
            if isinstance(field.default, int | float) and not isinstance(field.default, bool):
                out[prefix + name] = float(field.default)
    leaves: dict[str, set[float]] = {}
    for model in gen_docs._collector_models().values():
        for key, default, _bounds in gen_docs._walk(model, "", None):
            try:
                leaves.setdefault(key.rsplit(".", 1)[-1], set()).add(float(default))
            except ValueError:
                leaves.setdefault(key.rsplit(".", 1)[-1], set()).add(float("nan"))  # not a number: never matched
    for leaf, values in leaves.items():  # a key every component gives the same numeric default
        if len(values) == 1 and leaf not in out and values == {v for v in values if v == v}:
            out[leaf] = values.pop()
    for name in config._PARSERS:
        value = config._DEFAULTS[name]
        if isinstance(value, int | float) and not isinstance(value, bool) and name != "device_every":
            out[config.ENV_PREFIX + name.upper()] = float(value)
    return out


def _stated_defaults(text: str, defaults: dict[str, float]) -> list[tuple[int, str, float]]:
    """(line, key, value) wherever a doc states a key's value: a table row ``| `key` | N`` or ``| `key` | `N```,
    ``` `key` (N```, ``` `key` [N``` or ``` `key` = N``` in a sentence (an alternative measured or another
    component's setting is written otherwise: ``` `noise_z` 6 gave```)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for key in defaults:
            k = re.escape(key)
            for pattern in (rf"^\| `{k}` \| `?{_NUM}", rf"`{k}` [(\[]{_NUM}", rf"`{k}` = {_NUM}"):
                for m in re.finditer(pattern + _UNIT, line):
                    scale = _SCALE.get(m.group(2) or "", 1.0)
                    if m.group(2) and key.lower().endswith("_" + m.group(2).lower()):  # `limit_mib` (1024 MiB)
                        scale = 1.0
                    found.append((lineno, key, float(m.group(1)) * scale))
    return found


def test_no_doc_states_a_default_the_code_does_not_have() -> None:
    defaults = _defaults()
    assert defaults["max_open_windows"] == 64 and defaults["OTEL_STRAGGLER_MAX_OPEN_STEPS"] == 8
    wrong, seen = [], 0
    for doc in DOCS:
        for line, key, value in _stated_defaults(doc.read_text(encoding="utf-8"), defaults):
            seen += 1
            if value != defaults[key]:
                wrong.append(f"{doc.relative_to(ROOT)}:{line}: {key} = {value:g}, the code's default is "
                             f"{defaults[key]:g}")
    assert seen >= 80, seen  # the generated tables and the hand-written ones
    assert not wrong, wrong


def test_the_default_scanner_sees_the_drift_it_is_for() -> None:
    defaults = _defaults()
    drifted = "beyond its `max_open_windows` (8 windows of 5 steps)\n| `max_open_windows` | 8 | ... |\n"
    assert _stated_defaults(drifted, defaults) == [(1, "max_open_windows", 8.0), (2, "max_open_windows", 8.0)]
    assert _stated_defaults("`metrics.max_series` 10 000, `noise_z` 6 gave", defaults) == []
    assert set(_stated_defaults("`max_bytes` (100 MiB), `limit_mib` (1024 MiB)", defaults)) == {
        (1, "max_bytes", 100 * 1024.0**2), (1, "limit_mib", 1024.0)}


_KNOB_ROW = re.compile(r"^\| `([a-z_.]+)` \| `([^`]*)` \|([^|]*)\|", flags=re.M)


def _detector_knobs(text: str) -> dict[str, tuple[str, str]]:
    """key -> (default, allowed) of every knob row of docs/detector.md: ``| `key` | `default` | allowed |``."""
    from collector_processor.processor.straggler.config import Config

    keys = {key for key, _d, _b in gen_docs._walk(Config, "", None)}
    return {m.group(1): (m.group(2), m.group(3).strip()) for m in _KNOB_ROW.finditer(text) if m.group(1) in keys}


def _allowed(default: str, bounds: str) -> str:
    """What docs/detector.md says a key allows: the model's bounds, else the kind of value."""
    if bounds:
        return bounds
    if default in ("true", "false"):
        return "true, false"
    if ", " in default:
        return "stage names" if "-" in default else "stage groups"
    return "a string"


def test_the_detector_page_gives_every_processor_key_as_the_code_has_it() -> None:
    from collector_processor.processor.straggler.config import Config

    expected = {key: (gen_docs._cell(default), _allowed(default, gen_docs._cell(bounds)))
                for key, default, bounds in gen_docs._walk(Config, "", None)}
    documented = _detector_knobs((ROOT / "docs" / "detector.md").read_text(encoding="utf-8"))
    assert sorted(set(expected) - set(documented)) == [], "keys the page does not give"
    wrong = {k: (documented[k], expected[k]) for k in expected if documented[k] != expected[k]}
    assert not wrong, wrong


def test_the_detector_knob_check_sees_a_drifted_default_or_bound() -> None:
    drifted = "| `max_open_windows` | `8` | >= 1 |\n| `tolerance` | `0.04` | >= 0 |\n| `pair` | `true` | |\n"
    assert _detector_knobs(drifted) == {"max_open_windows": ("8", ">= 1"), "tolerance": ("0.04", ">= 0"),
                                        "pair": ("true", "")}
    assert _allowed("forward, backward", "") == "stage groups" and _allowed("5", "> 0") == "> 0"


def _registered_collector_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    from prometheus_client.metrics import MetricWrapperBase

    from collector_processor.processor.straggler.config import MetricsConfig
    from collector_processor.processor.straggler.metrics import StragglerMetrics
    from collector_processor.telemetry import Telemetry

    telemetry = Telemetry()
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for metric in vars(telemetry).values():
        if isinstance(metric, MetricWrapperBase):
            kind = metric._type
            out[metric._name + ("_total" if kind == "counter" else "")] = (kind, tuple(metric._labelnames))
    for fam in StragglerMetrics(MetricsConfig(), telemetry).describe():
        labels: Any = fam.samples[0].labels if fam.samples else getattr(fam, "_labelnames", ())
        out[fam.name + ("_total" if fam.type == "counter" else "")] = (fam.type, tuple(labels))
    return out


def test_the_collector_registers_exactly_the_contract_s_metrics() -> None:
    registered = _registered_collector_metrics()
    declared = {m.name: (m.kind, m.labels) for m in s.COLLECTOR_METRICS if not m.name.startswith(s.M_EMITTER_PREFIX)}
    assert registered == declared


def test_the_contract_s_metric_tables_name_every_metric_constant() -> None:
    constants = {v for k, v in vars(s).items() if k.startswith("M_") and k != "M_EMITTER_PREFIX"}
    assert {m.name for m in s.COLLECTOR_METRICS if not m.name.startswith(s.M_EMITTER_PREFIX)} == constants
    instruments = {v for k, v in vars(s).items() if k.startswith("SM_") and isinstance(v, str)
                   and v.startswith("otel_straggler.")}
    assert {m.name for m in s.EMITTER_METRICS} == instruments
    reasons = {m.name: m.labels for m in s.EMITTER_METRICS}
    assert reasons[s.SM_DROPPED] == (s.SM_REASON_ATTR,) and reasons[s.SM_FAULTS] == ("where",)
