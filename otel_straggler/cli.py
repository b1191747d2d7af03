"""``otel-straggler``: the project's command line (``doctor`` checks a node, ``token`` prints a job's bearer token;
other commands, such as ``demo``, come from the ``otel_straggler.commands`` entry points of the installed packages).

An entry point names a ``main(argv) -> int`` that parses its own options, and its module a one-line ``HELP``; it
is loaded only when its command runs (or for the top-level ``--help``), so the library imports none of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version

COMMANDS_GROUP = "otel_straggler.commands"


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


def commands() -> dict[str, EntryPoint]:
    """The installed commands (``otel_straggler.commands`` entry points), by name."""
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    plugged = commands()
    if argv[:1] and argv[0] in plugged:  # the command parses its own options
        return int(plugged[argv[0]].load()(argv[1:]))
    if argv[:1] == ["token"]:  # parses its own options; imports the schema alone
        from otel_straggler import job_token

        return job_token.main(argv[1:])
    parser = argparse.ArgumentParser(prog="otel-straggler")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    for name, ep in sorted(plugged.items()):  # listed here; ``otel-straggler NAME --help`` for more
        sub.add_parser(name, help=getattr(importlib.import_module(ep.module), "HELP", None), add_help=False)
    sub.add_parser("token", help="print the bearer token of one job, derived from the cluster's job secret",
                   add_help=False)
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
