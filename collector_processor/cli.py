"""``otel-straggler-collector --config collector.yaml [--config more.yaml] [--validate]``.

Several ``--config`` files merge in order (mappings deep-merge, lists are replaced). ``--validate`` checks the
configuration and exits 0 (valid) or 2 (invalid). Logs go to stderr; the listening addresses are logged at start.
SIGTERM / SIGINT drain the pipelines and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from importlib.metadata import PackageNotFoundError, version

from collector_processor.config.loader import ConfigError, load_files
from collector_processor.config.validate import CollectorConfig, validate

log = logging.getLogger("otel-straggler-collector")
EXIT_INVALID = 2


def load_config(paths: list[str]) -> CollectorConfig:
    raw, marks = load_files(paths)
    return validate(raw, marks)


def package_version() -> str:
    try:
        return version("otel-straggler")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="otel-straggler-collector", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    ap.add_argument("--config", action="append", required=True, help="YAML config file (repeatable; later wins)")
    ap.add_argument("--validate", action="store_true", help="check the configuration and exit (0 valid, 2 invalid)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"otel-straggler-collector: {e}", file=sys.stderr)
        return EXIT_INVALID
    if args.validate:
        print("configuration is valid", file=sys.stderr)
        return 0

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, draining", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)  # before anything binds: a TERM during start still drains
    signal.signal(signal.SIGINT, on_signal)

    from collector_processor.service import Service

    try:
        svc = Service(cfg)
        svc.start()
    except (OSError, ValueError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 1
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
