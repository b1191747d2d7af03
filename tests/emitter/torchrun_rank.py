"""One rank started by torchrun (``python -m torch.distributed.run ... torchrun_rank.py``): configures the emitter
from the environment alone (no job id given), times a few Megatron-like steps, prints its rank and job id."""

from __future__ import annotations

import json
import os
import time

import otel_straggler


def main() -> None:
    timers = otel_straggler.configure(enabled=True, readout_interval_ms=5)
    assert timers is not None
    for step in range(3):
        otel_straggler.step(step)
        with otel_straggler.stage("forward-compute"):
            time.sleep(0.002)
    # one write of the whole line: both workers share torchrun's stdout, and print() writes the text and its newline
    # separately when stdout is unbuffered (PYTHONUNBUFFERED), so two ranks' lines could interleave
    os.write(1, (json.dumps({"rank": timers.identity.rank, "job_id": timers.identity.job_id}) + "\n").encode())
    otel_straggler.shutdown(5.0)


if __name__ == "__main__":
    main()
