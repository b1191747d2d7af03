"""A trainer on the real Timers (default export_mode=process, lifecycle registered by ``configure``):
``python trainer_driver.py '<json>'``. Runs ``steps`` Megatron-like steps, prints a READY line with the time,
then either returns (``end: exit``: atexit does the bounded shutdown) or sleeps (``end: wait``: the test
signals it)."""

from __future__ import annotations

import json
import sys
import time

from otel_straggler.install import configure


def main() -> None:
    args = json.loads(sys.argv[1])
    timers = configure(enabled=True, job_id=args["job"], readout_interval_ms=5,
                       shutdown_timeout_s=args.get("shutdown_timeout_s", 2.0))
    assert timers is not None
    for step in range(1, args["steps"] + 1):
        timers.set_step(step, 4096, 8, 2)
        for _ in range(2):
            timers("forward-compute", log_level=2).start()
            time.sleep(0.001)
            timers("forward-compute").stop()
        timers("optimizer", log_level=1).start()
        timers("optimizer").stop()
    time.sleep(0.05)  # the readout thread (5 ms period) has handed every interval to the export child
    print(json.dumps({"ready": time.time(), "child_pid": getattr(timers.sink, "child_pid", None)}), flush=True)
    if args.get("end") == "wait":
        time.sleep(120)


if __name__ == "__main__":
    main()
