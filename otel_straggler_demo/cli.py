"""``otel-straggler demo``: the demo application's command line (``otel_straggler.cli`` dispatches to it).

Exit status: 0 when the injected rank was convicted and nobody else was (or, with ``--endpoint``, when every
rank finished), 1 when the run did not show that (the reasons are printed), 2 for options that cannot work
(checked before anything starts).
"""

from __future__ import annotations

import argparse
import signal
import sys

from otel_straggler_demo.options import MODELS, TOY, TOY_STAGES, DemoOptions, OptionError, default_inject_rank

HELP = "run N rank processes, slow one, and show the collector finding it"  # in ``otel-straggler --help``
DESCRIPTION = ("Runs a data-parallel demo job on this machine with the straggler collector on loopback, slows one "
               "rank, then prints what the collector found. Exits 1 when the slowed rank is not convicted or "
               "another one is.")


def parser() -> argparse.ArgumentParser:
    d = DemoOptions()
    p = argparse.ArgumentParser(prog="otel-straggler demo", description=DESCRIPTION)
    p.add_argument("--ranks", type=int, default=d.ranks, help="rank processes (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (default %(default)s)")
    p.add_argument("--microbatches", type=int, default=d.microbatches,
                   help="microbatches per step (default %(default)s)")
    p.add_argument("--model", default=d.model, choices=MODELS, metavar="MODEL",
                   help=f"{TOY}: a small model on CPU over gloo, its compute padded to realistic stage times; "
                        + ", ".join(m for m in MODELS if m != TOY)
                        + ": a real megatron-core GPT per rank (needs CUDA and megatron-core). Default %(default)s")
    p.add_argument("--inject-rank", type=int, default=None,
                   help="rank to slow down (default: 3, or the last rank of a smaller job; -1 for none)")
    p.add_argument("--inject-stage", default=d.inject_stage,
                   help=f"Megatron timer to slow ({TOY} model: {', '.join(TOY_STAGES)}; default %(default)s)")
    p.add_argument("--inject-slowdown", type=float, default=d.inject_slowdown,
                   help="fraction of the stage's nominal time (default %(default)s = +10%%)")
    p.add_argument("--inject-ms", type=float, default=None,
                   help="absolute delay per interval in ms (instead of --inject-slowdown)")
    p.add_argument("--inject-kind", choices=("host", "device"), default=d.inject_kind,
                   help="host sleep or extra GPU work (without CUDA: a host sleep; default %(default)s)")
    p.add_argument("--inject-from", type=int, default=d.inject_from, help="first slowed step (default %(default)s)")
    p.add_argument("--inject-until", type=int, default=None, help="first step back at par (default: never)")
    p.add_argument("--endpoint", default=None,
                   help="external collector OTLP endpoint (default: start one on loopback)")
    p.add_argument("--protocol", choices=("grpc", "http/protobuf"), default=d.protocol,
                   help="OTLP protocol of the ranks (default %(default)s)")
    p.add_argument("--out", default=d.out,
                   help="output folder: evidence, metrics, stage times, report, logs (default %(default)s)")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="stop and fail when rank 0 makes no progress for this many seconds (default %(default)s)")
    p.add_argument("--json", action="store_true", help="end with one JSON line summarising the run")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    inject_rank = default_inject_rank(args.ranks) if args.inject_rank is None else args.inject_rank
    opts = DemoOptions(
        ranks=args.ranks, steps=args.steps, microbatches=args.microbatches,
        inject_rank=None if inject_rank < 0 else inject_rank,
        inject_stage=args.inject_stage, inject_slowdown=args.inject_slowdown, inject_kind=args.inject_kind,
        inject_from=args.inject_from, inject_until=args.inject_until, endpoint=args.endpoint,
        protocol=args.protocol, out=args.out, json=args.json, quiet=args.quiet, model=args.model,
        inject_ms=args.inject_ms, stall_timeout_s=args.stall_timeout)
    try:
        from otel_straggler_demo.run import CollectorStartError, run_demo
    except ModuleNotFoundError as exc:  # the demo starts a collector: pip install 'otel-straggler[collector]'
        print(f"otel-straggler demo: needs the collector ({exc.name} is missing): "
              "pip install 'otel-straggler[collector]'", file=sys.stderr)
        return 1

    def _terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # run_demo stops its ranks and collector on the way out

    try:
        previous = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread (called from a test's worker): SIGTERM stays as it is
        previous = None
    try:
        result = run_demo(opts)  # checks the options before it starts anything
    except OptionError as exc:
        p.error(str(exc))  # exits 2
    except CollectorStartError as exc:
        print(f"otel-straggler demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("otel-straggler demo: interrupted; its ranks and collector are stopped", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
