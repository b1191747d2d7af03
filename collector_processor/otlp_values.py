"""Building OTLP attribute values from Python values (shared by the events, the simulator and tests)."""

from __future__ import annotations

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue


def any_value(value: object) -> AnyValue:
    """bool, int, float map to their OTLP kinds, a list or tuple to an array of them; else a string."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=str(value))


def key_value(key: str, value: object) -> KeyValue:
    return KeyValue(key=key, value=any_value(value))
