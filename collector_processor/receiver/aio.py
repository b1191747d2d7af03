"""What the asyncio-based receivers share: an event loop on its own thread (connections and streams waiting for
their client cost a coroutine, not a thread) and a small pool of daemon worker threads for decoding and handing
requests to the pipelines (blocking work that must not run on the loop, and that must not keep the process
alive after the drain)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self, timeout: float = 1.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


class Completions:
    """Futures of one event loop resolved from other threads, with one wake-up of the loop per batch.

    ``loop.call_soon_threadsafe`` writes to the loop's self-pipe on every call: a system call that hands the GIL
    to the loop thread, which the calling thread (a pipeline's worker, between two requests) then waits to get
    back. Here a thread that resolves a future while an earlier wake-up is still pending only appends to the
    batch; the loop resolves the whole batch at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._batch: deque[tuple[asyncio.Future[Any], Any]] = deque()
        self._lock = threading.Lock()
        self._pending = False

    def resolve(self, fut: asyncio.Future[Any], value: Any) -> None:
        """From any thread: ``fut.set_result(value)`` on the loop, unless it is done by then."""
        with self._lock:
            self._batch.append((fut, value))
            if self._pending:
                return
            self._pending = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, deque()
            self._pending = False
        for fut, value in batch:
            if not fut.done():
                fut.set_result(value)


class Workers:
    """``size`` daemon threads running blocking calls for coroutines (``await workers.run(fn, ...)``)."""

    def __init__(self, size: int, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, args, fut = job
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting coroutine
                _settle(fut, None, e)
            else:
                _settle(fut, result, None)

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._q.put((fn, args, fut))
        return fut

    def stop(self) -> None:
        for _ in self._threads:
            self._q.put(None)


def stop_runtime(workers: Workers | None, loop: LoopThread | None) -> None:
    """Stop a receiver's decode workers, then its event loop (either may never have started)."""
    if workers is not None:
        workers.stop()
    if loop is not None:
        loop.stop()


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    def done() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    try:
        fut.get_loop().call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass
