"""Megatron timer names -> stage groups, re-exported from ``otel_straggler_schema.stages`` (its home)."""

from otel_straggler_schema.stages import *  # noqa: F403
