"""One rank of the demo job: a small model trained data-parallel over gloo, timed with the shim.

The loop has Megatron's shape and timer names: ``forward-backward`` wraps per-microbatch
``batch-generator``, ``forward-compute`` and ``backward-compute`` plus ``all-grads-sync``; then
``optimizer`` wraps ``optimizer-inner-step``. On a CPU the real compute of a small model takes well under
a millisecond and eight ranks share two cores, so each compute stage also waits a fixed "accelerator time"
(``--forward-ms`` / ``--backward-ms`` per microbatch, with 1 % Gaussian jitter): that gives stage times of
a realistic size and spread, which is what the detector judges. The slowed rank is slowed only by the
package's test-only injection knob (``OTEL_STRAGGLER_INJECT_*``), set by the demo runner.

Run by ``otel_straggler_demo.run``; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    from otel_straggler_demo.options import MODELS, DemoOptions

    d = DemoOptions()
    p = argparse.ArgumentParser(prog="otel_straggler_demo.trainer")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--microbatches", type=int, default=d.microbatches)
    p.add_argument("--forward-ms", type=float, default=d.forward_ms)
    p.add_argument("--backward-ms", type=float, default=d.backward_ms)
    p.add_argument("--optimizer-ms", type=float, default=d.optimizer_ms)
    p.add_argument("--tokens-per-microbatch", type=int, default=2048)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--progress-every", type=int, default=5)
    p.add_argument("--model", default=d.model, choices=MODELS,
                   help="toy (CPU, gloo) or megatron:<size> (a real megatron-core GPT on CUDA, independent "
                        "replicas: every rank its own one-process NCCL world, same cohort)")
    p.add_argument("--gpu-turns", action="store_true",
                   help="megatron mode: ranks sharing one GPU run their steps in turn (round-robin through a "
                        "TCPStore), so no replica's device intervals include another's kernels")
    return p.parse_args(argv)


def _wait(ms: float, rng: random.Random) -> None:
    """Stand-in for accelerator time: a fixed duration with 1 % Gaussian jitter."""
    time.sleep(max(0.0, ms * (1.0 + rng.gauss(0.0, 0.01))) / 1000.0)


def _leave_collective(rng: random.Random) -> None:
    """Untimed host work of 0-2 ms after the all-reduce, in a random order across ranks, as ranks on separate
    hosts leave a collective. Eight ranks on two cores otherwise wake together from every all-reduce and queue
    for the CPU in much the same order each step, so the same rank starts its next stage late step after step:
    a host stall of the demo's own making."""
    time.sleep(rng.uniform(0.0, 0.002))


def _megatron_main(args: argparse.Namespace) -> int:
    """Independent megatron-core GPT replicas sharing the machine's GPU(s), timed by the shim."""
    import otel_straggler
    from otel_straggler_demo.megatron_gpt import SIZES, MegatronGPT, init_single_process

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    init_single_process(args.master_port + 1 + rank, rank_for_seed=rank)
    size = SIZES[args.model.split(":", 1)[1]]
    model = MegatronGPT(size)
    timers = otel_straggler.install_megatron(model.config, model.opt_config, enabled=True, set_global=False,
                                             rank=rank, world_size=world, local_rank=rank, dp_rank=rank,
                                             dp_size=world)
    model.set_timers(timers)
    turns = _GpuTurns(args.master_port, rank, world) if args.gpu_turns else None
    tokens = size.micro_batch * size.seq * size.microbatches
    for it in range(1, args.steps + 1):
        if turns is not None:
            turns.wait(it)
        otel_straggler.step(it, tokens=tokens, sequences=size.micro_batch * size.microbatches,
                            microbatches=size.microbatches)
        model.train_step()
        if turns is not None:
            model.torch.cuda.synchronize()
            turns.done(it)
        if rank == 0 and (it % args.progress_every == 0 or it == args.steps):
            print(json.dumps({"progress": it, "steps": args.steps}), flush=True)
    if turns is not None:
        turns.finish()
    if timers is not None:
        timers.shutdown(5.0)
    return 0


class _GpuTurns:
    """Round-robin use of a shared GPU: rank r runs step n after rank r-1 finished it (rank 0 after the last
    rank finished step n-1). Keys live in a TCPStore served by rank 0 on ``port``; each is deleted once used."""

    def __init__(self, port: int, rank: int, world: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.rank = rank
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=900))

    def _key(self, step: int, rank: int) -> str:
        return f"turn/{step}/{rank}"

    def wait(self, step: int) -> None:
        if step == 1 and self.rank == 0:
            return
        key = self._key(step, self.rank)
        self.store.wait([key])
        self.store.delete_key(key)

    def done(self, step: int) -> None:
        nxt = (step, self.rank + 1) if self.rank + 1 < self.world else (step + 1, 0)
        self.store.set(self._key(*nxt), b"1")

    def finish(self) -> None:
        """Rank 0 serves the store: it leaves only after every rank has finished its last step."""
        self.store.add("finished", 1)
        if self.rank == 0:
            import time as _t

            deadline = _t.monotonic() + 900
            while self.store.add("finished", 0) < self.world and _t.monotonic() < deadline:
                _t.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.model.startswith("megatron"):
        return _megatron_main(args)
    import torch
    import torch.distributed as dist

    import otel_straggler

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=rank, world_size=world
    )
    torch.manual_seed(1234)  # same init on every rank, like DP replicas
    rng = random.Random(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    timers = otel_straggler.install_megatron(enabled=True)
    if timers is None:  # pragma: no cover - install fails open; keep training untimed
        print(json.dumps({"rank": rank, "warning": "timers not installed"}), flush=True)
        timers = otel_straggler.Timers(2, "minmax")

    mb_tokens = args.tokens_per_microbatch
    for it in range(1, args.steps + 1):
        otel_straggler.step(it, tokens=mb_tokens * args.microbatches, sequences=8 * args.microbatches,
                            microbatches=args.microbatches)
        timers("forward-backward", log_level=1).start()
        for _ in range(args.microbatches):
            timers("forward-compute", log_level=2).start()
            timers("batch-generator", log_level=2).start()
            x = torch.randn(8, 64, generator=gen)
            timers("batch-generator").stop()
            loss = model(x).pow(2).mean()
            _wait(args.forward_ms, rng)
            timers("forward-compute").stop()
            timers("backward-compute", log_level=2).start()
            loss.backward()
            _wait(args.backward_ms, rng)
            timers("backward-compute").stop()
        timers("all-grads-sync", log_level=1).start()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        timers("all-grads-sync").stop()
        timers("forward-backward").stop()
        _leave_collective(rng)
        timers("optimizer", log_level=1).start()
        timers("optimizer-inner-step", log_level=1).start()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _wait(args.optimizer_ms, rng)
        timers("optimizer-inner-step").stop()
        timers("optimizer").stop()
        if rank == 0 and (it % args.progress_every == 0 or it == args.steps):
            print(json.dumps({"progress": it, "steps": args.steps, "loss": float(loss.detach())}), flush=True)

    timers.shutdown(5.0)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
