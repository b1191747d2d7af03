"""``otel-straggler``: the project's command line (``doctor`` checks a node, ``demo`` runs the end-to-end demo).

``demo`` is the demo application (``otel_straggler_demo.cli``): loaded only when that command runs, so no
library module of the emitter imports it.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("otel-straggler")
    except PackageNotFoundError:
        return "unknown (not installed)"


def version_text() -> str:
    """``otel-straggler X.Y.Z (hot path: native (C extension), Python 3.11.7)``."""
    from otel_straggler import hot_path

    python = ".".join(map(str, sys.version_info[:3]))
    return f"otel-straggler {package_version()} (hot path: {hot_path.describe()}, Python {python})"


DEMO_HELP = "run N rank processes, slow one, and show the collector finding it"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo application parses its own options
        from otel_straggler_demo.cli import main as demo_main

        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="otel-straggler")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help=DEMO_HELP, add_help=False)  # listed here; ``otel-straggler demo --help`` for more
    doc = sub.add_parser("doctor", help="say what the emitter will do on this node, and check the collector",
                         description="Checks, from this environment: enabled, settings, hot path, torch/CUDA, "
                                     "launcher ranks, job and run ids, whether the OTLP endpoint takes trace "
                                     "exports and the collector's clock. Exits 1 when a check fails.")
    doc.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    doc.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the endpoint (default 5)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from otel_straggler import doctor

        return doctor.run(as_json=args.json, timeout_s=args.timeout)
    return 2


if __name__ == "__main__":
    sys.exit(main())
