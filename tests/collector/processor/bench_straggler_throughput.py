"""Throughput of ``StragglerProcessor.process_traces`` on realistic 513-span requests (not a test).

Run: ``python tests/collector/processor/bench_straggler_throughput.py``. Each request holds 9 steps of an
8-rank job (6 stage spans + rank-step per rank per step, plus rank 0's train-step), the shape a batching
exporter sends; windows close and verdicts are judged along the way, as in production.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from straggler_sim import Sim, make_processor

from collector_processor.processor.straggler.decode import decode_request
from jobsim.arrival import SimClock


def main(requests: int = 200, repeats: int = 3) -> None:
    sim = Sim()
    reqs = [sim.request(list(range(i * 9, i * 9 + 9))) for i in range(requests)]
    n = sum(len(ss.spans) for rs in reqs[0].resource_spans for ss in rs.scope_spans)
    best_decode = best_full = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        for r in reqs:
            decode_request(r.resource_spans)
        best_decode = max(best_decode, n * requests / (time.perf_counter() - t))
        clock = SimClock()
        proc, _, _ = make_processor(clock=clock)
        t = time.perf_counter()
        for r in reqs:
            proc.process_traces(r)
            clock.t += 2.7
        best_full = max(best_full, n * requests / (time.perf_counter() - t))
    print(f"spans/request {n}; decode {best_decode:,.0f} spans/s; process_traces {best_full:,.0f} spans/s; "
          f"windows closed {proc.stats()['windows_closed']}")


if __name__ == "__main__":
    main()
