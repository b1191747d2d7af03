"""A trainer with a real torch DataLoader (num_workers=2, fork): ``python fork_driver.py '<json>'``.

The workers time their own ``stage`` calls on their (forked, inert) copy of the Timers; the trainer times its
steps. Prints one JSON line: the trainer pid, its export child pid, the steps run and the flush result.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from otel_straggler.install import configure, get_timers, stage, step


class Slow(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        with stage("worker-load"):  # runs in a forked worker: must export nothing
            time.sleep(0.001)
        return torch.full((4,), float(i))


def main() -> None:
    args = json.loads(sys.argv[1])
    timers = configure(enabled=True, job_id=args["job"], readout_interval_ms=5, export_mode="process")
    assert timers is not None
    with stage("warmup"):  # the export child starts before the fork
        pass
    timers.flush(5.0)
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    n = 1  # step 0 holds the warmup stage, already flushed (closed)
    for _epoch in range(2):
        for batch in loader:
            step(n, tokens=int(batch.numel()))
            with stage("forward-compute"):
                time.sleep(0.002)
            n += 1
    ok = timers.flush(10.0)
    print(json.dumps({"pid": os.getpid(), "child_pid": getattr(get_timers().sink, "child_pid", None), "steps": n - 1,
                      "flush": ok}), flush=True)


if __name__ == "__main__":
    main()
