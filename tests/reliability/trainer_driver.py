"""A trainer on the real Timers (default export_mode=process, lifecycle registered by ``configure``):
``python trainer_driver.py '<json>'``. Runs ``steps`` Megatron-like steps, prints a READY line with the time,
then either returns (``end: exit``: atexit does the bounded shutdown) or sleeps (``end: wait``: the test
signals it).

``end: checkpoint`` installs the program's own SIGTERM handler (it only records the signal, as a trainer that
checkpoints on SIGTERM does) and ``end: ignore`` ignores SIGTERM, both before ``configure``; after READY the
trainer waits for a line on stdin (the test sends SIGTERM first), runs ``more_steps`` further steps, prints
a second line and exits normally.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from otel_straggler.install import configure


def run_steps(timers, first: int, last: int) -> None:  # type: ignore[no-untyped-def]
    for step in range(first, last + 1):
        timers.set_step(step, 4096, 8, 2)
        for _ in range(2):
            timers("forward-compute", log_level=2).start()
            time.sleep(0.001)
            timers("forward-compute").stop()
        timers("optimizer", log_level=1).start()
        timers("optimizer").stop()


def main() -> None:
    args = json.loads(sys.argv[1])
    end = args.get("end")
    signals: list[int] = []
    if end == "checkpoint":
        signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))
    elif end == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    timers = configure(enabled=True, job_id=args["job"], readout_interval_ms=5,
                       shutdown_timeout_s=args.get("shutdown_timeout_s", 2.0))
    assert timers is not None
    steps = args["steps"]
    run_steps(timers, 1, steps)
    time.sleep(0.05)  # the readout thread (5 ms period) has handed every interval to the export child
    print(json.dumps({"ready": time.time(), "child_pid": getattr(timers.sink, "child_pid", None)}), flush=True)
    if end == "wait":
        time.sleep(120)
    elif end in ("checkpoint", "ignore"):
        sys.stdin.readline()  # the test has sent SIGTERM by now
        run_steps(timers, steps + 1, steps + args.get("more_steps", 0))
        print(json.dumps({"signals": len(signals)}), flush=True)


if __name__ == "__main__":
    main()
