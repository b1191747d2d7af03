"""Futures of a receiver's event loop resolved from other threads (``receiver.aio.Completions``)."""

from __future__ import annotations

import asyncio
import threading

from collector_processor.receiver.aio import Completions


def test_futures_resolved_from_threads_in_batches() -> None:
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        completions = Completions(loop)
        wakes = [0]
        drain = completions._drain

        def counted() -> None:
            wakes[0] += 1
            drain()

        completions._drain = counted  # type: ignore[method-assign]
        futs = [loop.create_future() for _ in range(200)]
        done_early = loop.create_future()
        done_early.set_result(-1)  # already done: left as it is

        def resolve_all() -> None:  # the loop cannot run meanwhile: one wake-up for the whole batch
            for i, f in enumerate(futs):
                completions.resolve(f, i)
            completions.resolve(done_early, 99)

        t = threading.Thread(target=resolve_all)
        t.start()
        t.join()
        values = list(await asyncio.gather(*futs))
        assert done_early.result() == -1
        return values, wakes[0]

    values, wakes = asyncio.run(main())
    assert values == list(range(200))
    assert wakes == 1


def test_a_closed_loop_is_ignored() -> None:
    loop = asyncio.new_event_loop()
    completions = Completions(loop)
    fut = loop.create_future()
    loop.close()
    completions.resolve(fut, 1)  # nobody waits any more: no error
    assert not fut.done()
