"""The contract the emitter and the collector share, re-exported from ``otel_straggler_schema`` (its home)."""

from otel_straggler_schema import *  # noqa: F403
