"""Building OTLP attribute values from Python values (shared by the events, the simulator and tests)."""

from __future__ import annotations

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def key_value(key: str, value: object) -> KeyValue:
    """bool, int, float map to their OTLP kinds; anything else becomes a string."""
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))
