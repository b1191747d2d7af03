"""``otel-straggler``: the project's command line (``demo`` runs the end-to-end demo)."""

from __future__ import annotations

import argparse
import sys


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run N rank processes, slow one, and show the collector finding it",
                       description="Runs a data-parallel demo job on this machine (CPU, gloo) with the "
                                   "straggler collector on loopback, then prints what it found.")
    p.add_argument("--ranks", type=int, default=8, help="rank processes (default 8)")
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--inject-rank", type=int, default=3, help="rank to slow down (default 3; -1 for none)")
    p.add_argument("--inject-stage", default="forward-compute", help="Megatron timer to slow (default forward-compute)")
    p.add_argument("--inject-slowdown", type=float, default=0.10, help="fraction, e.g. 0.10 = +10%% (default)")
    p.add_argument("--inject-kind", choices=("host", "device"), default="host",
                   help="host sleep or extra GPU work (device needs CUDA; on CPU it waits on the host)")
    p.add_argument("--inject-from", type=int, default=50, help="first slowed step (default 50)")
    p.add_argument("--inject-until", type=int, default=None, help="first step back at par (default: never)")
    p.add_argument("--endpoint", default=None,
                   help="external collector OTLP endpoint (default: start one on loopback)")
    p.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc")
    p.add_argument("--out", default="otel-straggler-demo", help="output folder (evidence, report, logs)")
    p.add_argument("--model", default="toy",
                   help="toy (default: CPU, gloo) or megatron:launch-bound / megatron:gpu-bound (a real "
                        "megatron-core GPT per rank on CUDA)")
    p.add_argument("--inject-ms", type=float, default=None,
                   help="absolute injected delay per interval in ms (overrides --inject-slowdown)")
    p.add_argument("--json", action="store_true", help="end with one JSON line summarising the run")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-straggler")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from otel_straggler.demo.run import DemoOptions, run_demo

        for name in ("ranks", "steps", "microbatches"):
            if getattr(args, name) < 1:
                parser.error(f"--{name} must be >= 1")
        if args.ranks < 2:
            parser.error("--ranks must be >= 2: a straggler is slow relative to its peers")
        if not 0 <= args.inject_slowdown <= 10:
            parser.error("--inject-slowdown is a fraction between 0 and 10 (0.10 = +10%)")
        if args.inject_rank is not None and args.inject_rank >= args.ranks:
            parser.error(f"--inject-rank {args.inject_rank} is not below --ranks {args.ranks}")
        opts = DemoOptions(
            ranks=args.ranks, steps=args.steps, microbatches=args.microbatches,
            inject_rank=None if args.inject_rank is None or args.inject_rank < 0 else args.inject_rank,
            inject_stage=args.inject_stage, inject_slowdown=args.inject_slowdown, inject_kind=args.inject_kind,
            inject_from=args.inject_from, inject_until=args.inject_until, endpoint=args.endpoint,
            protocol=args.protocol, out=args.out, json=args.json, quiet=args.quiet, model=args.model,
            inject_ms=args.inject_ms)
        result = run_demo(opts)
        return 0 if result.ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
