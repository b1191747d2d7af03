"""OTel metric name, unit and kind -> Prometheus metric name, by the OTel "Prometheus and OpenMetrics
Compatibility" rules (as the OTel Collector's Prometheus exporters apply them):

- characters outside ``[a-zA-Z0-9_:]`` become ``_`` (``otel_straggler.emitter.readout.lag`` ->
  ``otel_straggler_emitter_readout_lag``), repeated and trailing underscores collapse;
- the UCUM unit becomes a suffix in its Prometheus word: ``s`` -> ``_seconds``, ``By`` -> ``_bytes``,
  ``By/s`` -> ``_bytes_per_second``; an annotation (``{packet}``) and the dimensionless ``1`` add none; a unit
  outside the table is appended as its letters and digits;
- a monotonic sum (a counter) ends in ``_total``;
- a suffix the name already ends with is not repeated.

One departure: a gauge of unit ``1`` gets no ``_ratio`` suffix. The emitters' ``1`` gauges are counts (most CUDA
events in flight), not ratios, and their documented Prometheus names carry no unit (docs/schema.md).
"""

from __future__ import annotations

import re

# UCUM unit -> Prometheus unit word (the OTel Collector's translator table)
UNIT_WORDS: dict[str, str] = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds", "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes", "TiBy": "tebibytes",
    "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams",
    "Cel": "celsius", "Hz": "hertz", "%": "percent", "1": "",
}
# the denominator of a rate unit (``By/s``) -> ``per_<word>``
PER_UNIT_WORDS: dict[str, str] = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month",
                                  "y": "year"}
_BAD = re.compile(r"[^a-zA-Z0-9_:]+")
_NOT_ALNUM = re.compile(r"[^a-zA-Z0-9]+")
_ANNOTATION = re.compile(r"\{[^}]*\}")


def _word(unit: str, table: dict[str, str]) -> str:
    unit = _ANNOTATION.sub("", unit).strip()
    if not unit:
        return ""
    return table[unit] if unit in table else _NOT_ALNUM.sub("", unit)


def unit_suffix(unit: str) -> str:
    """The Prometheus suffix words of a UCUM unit, without the leading underscore (``""`` for none)."""
    main, sep, per = unit.partition("/")
    words = _word(main, UNIT_WORDS)
    per_word = _word(per, PER_UNIT_WORDS) if sep else ""
    if per_word:
        words = f"{words}_per_{per_word}" if words else f"per_{per_word}"
    return words


def prometheus_name(name: str, unit: str, counter: bool) -> str:
    """The Prometheus name of an OTel metric ``name`` of ``unit``; ``counter``: a monotonic sum (``_total``)."""
    out = re.sub(r"_{2,}", "_", _BAD.sub("_", name)).strip("_")
    if out[:1].isdigit():
        out = "_" + out
    if counter:
        out = out.removesuffix("_total")
    suffix = unit_suffix(unit)
    if suffix and not out.endswith("_" + suffix):
        out += "_" + suffix
    return out + "_total" if counter else out
