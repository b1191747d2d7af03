"""The ``otel-straggler-collector`` script and ``python -m collector_processor``.

The script is in every install of the wheel (an entry point cannot depend on an extra), while what the collector
runs on comes with the ``collector`` extra. This module imports only the standard library: without the extra the
script says so in one line and exits 2, instead of a traceback from the first missing import.
"""

from __future__ import annotations

import importlib.util
import sys

EXTRA = "otel-straggler[collector]"
EXIT_MISSING_EXTRA = 2
# module the collector imports -> the distribution of the ``collector`` extra that provides it
REQUIRED: dict[str, str] = {
    "yaml": "pyyaml",
    "pydantic": "pydantic",
    "prometheus_client": "prometheus-client",
    "google.protobuf": "protobuf",
    "opentelemetry.proto": "opentelemetry-proto",
    "grpc": "grpcio",
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing (``google`` for ``google.protobuf``) or refuses to import
        return False


def missing_distributions() -> list[str]:
    """The distributions of the ``collector`` extra whose modules cannot be imported here."""
    return [dist for module, dist in REQUIRED.items() if not _importable(module)]


def main(argv: list[str] | None = None) -> int:
    gone = missing_distributions()
    if gone:
        print(f"otel-straggler-collector: needs the collector extra, missing {', '.join(gone)}: "
              f"pip install '{EXTRA}'", file=sys.stderr)
        return EXIT_MISSING_EXTRA
    from collector_processor.cli import main as run

    return run(argv)
