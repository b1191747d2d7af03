"""The GPU-turns protocol of the megatron demo mode (``--gpu-turns``): strict round-robin over ranks, step by
step, through a real TCPStore; rank 0 (the store's server) leaves only after every rank finished."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("torch.distributed")

from otel_straggler_demo.trainer import _GpuTurns


def _port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def test_ranks_take_turns_in_order_and_rank0_waits_for_all() -> None:
    port, world, steps = _port(), 3, 4
    order: list[tuple[int, int]] = []
    finished: dict[int, float] = {}
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        turns = _GpuTurns(port, rank, world)
        for it in range(1, steps + 1):
            turns.wait(it)
            with lock:
                order.append((it, rank))
            if rank == 2:
                time.sleep(0.01)  # a slow rank holds everyone's next turn
            turns.done(it)
        turns.finish()
        finished[rank] = time.monotonic()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert order == [(it, r) for it in range(1, steps + 1) for r in range(world)]
    assert finished[0] >= max(finished[1], finished[2])
