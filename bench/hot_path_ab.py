"""The C hot path against the Python one, where a start+stop's code and data are cold.

The implementation is chosen when ``otel_straggler`` is imported (``OTEL_STRAGGLER_HOT_PATH``,
``otel_straggler/hot_path.py``), so each runs in its own child process: ``bench/in_situ.py``'s rounds (one
interval around one small operation after 3 or 30 others, each arm's iteration time minus the same round's
iterations without a timer, blocks of arms taking turns). Children alternate, ``--pairs`` of each, the order
flipped every pair; each child's per-arm mean is one sample, and the table gives the mean over children and the
ratio native / python of those means.

Arms (``in_situ.py``): ``noop`` (Megatron's call shape into a no-op timer), ``host`` (the timers on a step that is
not device-sampled), ``device`` (a device-sampled step: event records; CUDA only).

Usage: ``python bench/hot_path_ab.py`` (``--device cuda`` on a GPU machine). Needs the C extension built
(``pip install -e .``, or ``scripts/gpu-native`` for the GPU machine). Last line:
``python_host_us_ops30= native_host_us_ops30= host_ratio_ops30= python_device_us_ops30= native_device_us_ops30=
device_ratio_ops30=`` (device fields only with ``--device cuda``).

``--base PATH``: a checkout of another commit with its C extension built (``git archive <commit> | tar -x -C PATH``,
then ``OTEL_STRAGGLER_BUILD_NATIVE=1 python setup.py build_ext --inplace`` there). Its children (its own
``bench/in_situ.py``) take turns with this checkout's, both implementations each, and the table gains the base's
columns and the ratio this / base per implementation; last line ``base_python_host_us_ops30= python_host_us_ops30=
base_native_host_us_ops30= native_host_us_ops30=``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMPLS = ("python", "native")
PREFIX = "start+stop between "


def child(impl: str, args: argparse.Namespace, root: Path = HERE.parent) -> dict[int, dict]:
    """One ``in_situ.py`` run of the checkout ``root`` on ``impl``: {ops: in_situ's result}; checks the child ran that
    implementation."""
    env = dict(os.environ, OTEL_STRAGGLER_HOT_PATH=impl, PYTHONPATH=str(root))
    argv = [str(root / "bench" / "in_situ.py"), "--device", args.device, "--iters", str(args.iters), "--blocks",
            str(args.blocks)]
    code = ("import sys, runpy; from otel_straggler import hot_path; print('hot_path=' + hot_path.NAME, flush=True);"
            f"sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=root).stdout
    lines = out.splitlines()
    if f"hot_path={impl}" not in lines:
        raise SystemExit(f"the {impl} child ran {lines[:1]}: is the C extension built?")
    res = {}
    for line in lines:
        if line.startswith(PREFIX):
            ops, _, blob = line[len(PREFIX):].partition(" ops: ")
            res[int(ops)] = json.loads(blob)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--pairs", type=int, default=3, help="child runs of each implementation")
    ap.add_argument("--iters", type=int, default=1200)
    ap.add_argument("--blocks", type=int, default=150)
    ap.add_argument("--base", type=Path, metavar="PATH", help="a checkout of another commit, side by side")
    args = ap.parse_args(argv)
    arms = ("noop", "host", "device") if args.device == "cuda" else ("noop", "host")
    if args.base is not None:
        return side_by_side(args, arms, args.base.resolve())
    samples: dict[tuple[str, int, str], list[float]] = {}
    for k in range(args.pairs):
        for impl in IMPLS if k % 2 == 0 else IMPLS[::-1]:
            res = child(impl, args)
            for ops, r in res.items():
                for arm in arms:
                    samples.setdefault((impl, ops, arm), []).append(r[arm]["mean_us"])
            print(f"pair {k + 1}/{args.pairs} {impl}: " + " ".join(
                f"{arm}@{ops}={res[ops][arm]['mean_us']:.2f}" for ops in sorted(res) for arm in arms), flush=True)
    mean = {key: statistics.fmean(v) for key, v in samples.items()}
    print(f"\nextra us per start+stop (mean of {args.pairs} children each; device {args.device})")
    print("| after | arm | python | native | native / python |")
    print("|---|---|---|---|---|")
    for ops in (3, 30):
        for arm in arms:
            p, n = mean[("python", ops, arm)], mean[("native", ops, arm)]
            print(f"| {ops} ops | {arm} | {p:.2f} | {n:.2f} | {n / p:.2f} |" if p > 0 else
                  f"| {ops} ops | {arm} | {p:.2f} | {n:.2f} | - |")
    last = []
    for arm in arms[1:]:
        p, n = mean[("python", 30, arm)], mean[("native", 30, arm)]
        last += [f"python_{arm}_us_ops30={p:.2f}", f"native_{arm}_us_ops30={n:.2f}",
                 f"{arm}_ratio_ops30={n / p:.3f}" if p > 0 else f"{arm}_ratio_ops30=nan"]
    print(" ".join(last))
    return 0


def side_by_side(args: argparse.Namespace, arms: tuple[str, ...], base: Path) -> int:
    """Children of ``base`` and of this checkout, each implementation, in turns (the order flipped every pair)."""
    if not (base / "bench" / "in_situ.py").is_file():
        raise SystemExit(f"--base {base}: not a checkout (no bench/in_situ.py)")
    roots = {"base": base, "this": HERE.parent}
    runs = [(tree, impl) for tree in roots for impl in IMPLS]
    samples: dict[tuple[str, str, int, str], list[float]] = {}
    for k in range(args.pairs):
        for tree, impl in runs if k % 2 == 0 else runs[::-1]:
            res = child(impl, args, roots[tree])
            for ops, r in res.items():
                for arm in arms:
                    samples.setdefault((tree, impl, ops, arm), []).append(r[arm]["mean_us"])
            print(f"pair {k + 1}/{args.pairs} {tree} {impl}: " + " ".join(
                f"{arm}@{ops}={res[ops][arm]['mean_us']:.2f}" for ops in sorted(res) for arm in arms), flush=True)
    mean = {key: statistics.fmean(v) for key, v in samples.items()}
    print(f"\nbase: {base}\nextra us per start+stop (mean of {args.pairs} children each; device {args.device})")
    print("| after | arm | impl | base | this | this / base |")
    print("|---|---|---|---|---|---|")
    for ops in (3, 30):
        for arm in arms:
            for impl in IMPLS:
                b, t = mean[("base", impl, ops, arm)], mean[("this", impl, ops, arm)]
                print(f"| {ops} ops | {arm} | {impl} | {b:.2f} | {t:.2f} | " + (f"{t / b:.2f} |" if b > 0 else "- |"))
    print(" ".join(f"{pre}{impl}_{arm}_us_ops30={mean[(tree, impl, 30, arm)]:.2f}" for arm in arms[1:]
                   for impl in IMPLS for tree, pre in (("base", "base_"), ("this", ""))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
