"""``otel-straggler-collector [--config collector.yaml [--config more.yaml]] [--validate] [--print-config]``.

Without ``--config`` the collector runs the configuration shipped in the package (``collector_processor/config/
collector.yaml``, in the checkout a link to ``configs/collector.yaml``: loopback OTLP on 4317/4318, Prometheus on
9464, every address settable through ``${env:...}``).
Several ``--config`` files merge in order (mappings deep-merge, lists are replaced). ``--validate`` checks the
configuration and exits 0 (valid) or 2 (invalid); ``--print-config`` prints the effective YAML (files merged,
``${env:...}`` substituted, secrets redacted) and exits the same way. Logs go to stderr; the listening addresses are
logged at start. SIGTERM / SIGINT drain the pipelines and exit 0.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

from collector_processor import allocator, preflight
from collector_processor.config.loader import ConfigError, load_files
from collector_processor.config.validate import CollectorConfig, validate

log = logging.getLogger("otel-straggler-collector")
EXIT_INVALID = 2
DEFAULT_CONFIG = "collector.yaml"  # in collector_processor/config/ (package data)
REDACTED = "<redacted>"
_SECRET_KEYS = ("token", "password", "secret", "authorization", "headers")
# Young-generation collections: Python's default (every 700 net container allocations) ran ~285 collections for
# 1,280 requests of the throughput bench's load, 5 % of decoding and processing them (in process, gc.callbacks);
# at 10,000 one ran. At most that many uncollected young objects wait a little longer (a few MiB); the memory
# limiter still collects everything when it nears its limit.
GC_YOUNG_THRESHOLD = 10_000


@contextmanager
def default_config_path() -> Iterator[Path]:
    """The shipped configuration as a file path (it is one in every wheel and editable install)."""
    with resources.as_file(resources.files("collector_processor.config") / DEFAULT_CONFIG) as path:
        yield path


def load_config(paths: list[str]) -> CollectorConfig:
    raw, marks = load_files(paths)
    return validate(raw, marks)


def redact(raw: Any) -> Any:
    """A copy of a raw configuration with the value of every secret-looking key (tokens, passwords, headers)
    replaced when it is set."""
    if isinstance(raw, dict):
        out = {}
        for key, value in raw.items():
            secret = isinstance(key, str) and any(s in key.lower() for s in _SECRET_KEYS)
            out[key] = REDACTED if secret and value not in (None, "", {}, []) else redact(value)
        return out
    if isinstance(raw, list):
        return [redact(v) for v in raw]
    return raw


def effective_yaml(paths: list[str]) -> str:
    """The merged, substituted, validated configuration as YAML (secrets redacted)."""
    raw, marks = load_files(paths)
    validate(raw, marks)
    return yaml.safe_dump(redact(raw), sort_keys=False, default_flow_style=False)


def package_version() -> str:
    try:
        return version("otel-straggler")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="otel-straggler-collector", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    ap.add_argument("--config", action="append",
                    help="YAML config file (repeatable; later wins). Default: the configuration shipped in the package")
    ap.add_argument("--validate", action="store_true", help="check the configuration and exit (0 valid, 2 invalid)")
    ap.add_argument("--print-config", action="store_true",
                    help="print the effective configuration as YAML and exit (0 valid, 2 invalid)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with default_config_path() as default:
        paths = args.config or [str(default)]
        try:
            if args.print_config:
                sys.stdout.write(effective_yaml(paths))
                return 0
            cfg = load_config(paths)
            raw, _marks = load_files(paths)
        except ConfigError as e:
            print(f"otel-straggler-collector: {e}", file=sys.stderr)
            return EXIT_INVALID
    if args.validate:
        print("configuration is valid", file=sys.stderr)
        return 0
    log.info("otel-straggler-collector %s, configuration: %s", package_version(),
             ", ".join(args.config) if args.config else "built-in (--print-config shows it)")

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)  # before anything binds: a TERM during start still drains
    signal.signal(signal.SIGINT, on_signal)

    from collector_processor.service import Service

    for what in preflight.exposed(raw):  # one line each: reachable from the network without credentials
        log.warning("%s listens beyond loopback without authentication: anyone who reaches it can write any job's "
                    "spans or read every job's series; set its auth (docs/reliability.md, section 4)", what)
    taken = preflight.clashes(raw)
    if taken:  # every clash in one message, before anything binds
        log.error("cannot start: cannot listen on %d address(es): %s", len(taken), "; ".join(taken))
        return 1
    try:
        svc = Service(cfg)
        svc.start()
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 1
    allocator.tune()  # no heap shrink and regrow per request (collector_processor/allocator.py)
    gc.freeze()  # what start built lives as long as the process: no collection scans it again
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    for line in svc.endpoints():
        log.info("listening: %s", line)
    while not stop.wait(1.0):
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills
    clean = svc.shutdown()
    log.info("exit (%s)", "drained" if clean else "timed out draining")
    return 0


if __name__ == "__main__":
    sys.exit(main())
