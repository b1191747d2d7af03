"""What gRPC calls may hold while their message has not arrived: a place among the calls in progress (per
listener and per peer address) and, once admitted, one of the read slots that bound the messages being read at
once. A call that sends its message holds them for milliseconds; one that never does would hold them until its
read timeout. So under pressure (no place, or no slot, left) the oldest call still waiting for its message, once
it has waited ``stall_s``, is ended (``evict``) and its place or slot goes to the newcomer: calls that never send
cannot starve calls that do, whoever holds the token. Runs on the receiver's event loop only (no locks)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Call:
    peer: str
    started: float
    waiting: bool = True  # its message has not arrived yet (it may be ended under pressure)
    evicted: bool = False
    expired: bool = False  # its read timeout passed
    holds_slot: bool = False
    left: bool = False
    task: asyncio.Future[object] | None = field(default=None, repr=False)  # what it awaits, cancelled on eviction


class Evicted(Exception):
    """The call was ended to make room: it had waited ``stall_s`` without its message while others waited."""


class CallBudget:
    def __init__(self, max_calls: int, max_per_peer: int, stall_s: float, slots: int | None) -> None:
        self.max_calls = max_calls
        self.max_per_peer = max_per_peer
        self.stall_s = stall_s
        self.calls = 0
        self.evicted = 0
        self._per_peer: dict[str, int] = {}
        self._waiting: dict[Call, None] = {}  # oldest first
        self._free = slots  # None: no read slots
        self._slot_waiters: deque[asyncio.Future[None]] = deque()

    # ---- places ----------------------------------------------------------------------------------------------
    def admit(self, peer: str, now: float) -> Call | None:
        """A place for a new call of ``peer``, making room by ending a stalled call if needed; None when the
        listener (or the peer) is full of calls that are not stalled."""
        if self.calls >= self.max_calls and not self._evict(now, None):
            return None
        if self._per_peer.get(peer, 0) >= self.max_per_peer and not self._evict(now, lambda c: c.peer == peer):
            return None
        call = Call(peer, now)
        self.calls += 1
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._waiting[call] = None
        return call

    def arrived(self, call: Call) -> None:
        """Its message is in: it is no longer ended under pressure."""
        call.waiting = False
        self._waiting.pop(call, None)

    def leave(self, call: Call) -> None:
        if call.left:
            return
        call.left = True
        self._waiting.pop(call, None)
        self.calls -= 1
        n = self._per_peer.get(call.peer, 0) - 1
        if n > 0:
            self._per_peer[call.peer] = n
        else:
            self._per_peer.pop(call.peer, None)
        if call.holds_slot:
            call.holds_slot = False
            self._release_slot()

    def _evict(self, now: float, which: object) -> bool:
        for call in self._waiting:
            if now - call.started < self.stall_s:
                return False  # the rest are younger
            if which is None or which(call):  # type: ignore[operator]
                self._end(call)
                return True
        return False

    def _end(self, call: Call) -> None:
        call.evicted = True
        self.evicted += 1
        task = call.task
        self.leave(call)
        if task is not None and not task.done():
            task.cancel()

    # ---- read slots ------------------------------------------------------------------------------------------
    @property
    def has_slots(self) -> bool:
        return self._free is not None

    async def slot(self, call: Call, timeout: float) -> bool:
        """Take a read slot within ``timeout`` (False when none came); ends a stalled slot holder when every slot
        is taken. Raises ``Evicted`` when the call itself is ended meanwhile."""
        assert self._free is not None
        if self._free > 0 and not self._slot_waiters:
            self._free -= 1
            call.holds_slot = True
            return True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            now = loop.time()
            if self._evict(now, lambda c: c.holds_slot) and self._free > 0 and not self._slot_waiters:
                self._free -= 1
                call.holds_slot = True
                return True
            left = end - now
            if left <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._slot_waiters.append(fut)
            call.task = fut  # type: ignore[assignment]
            try:
                await asyncio.wait_for(fut, min(left, max(self.stall_s, 0.01)))
            except TimeoutError:
                continue  # try to end a stalled holder, then wait again
            except asyncio.CancelledError:
                if call.evicted:
                    raise Evicted from None
                raise
            finally:
                call.task = None
                try:
                    self._slot_waiters.remove(fut)
                except ValueError:
                    pass
            if call.left:  # handed a slot after it was ended: give it back
                self._release_slot()
                raise Evicted
            call.holds_slot = True
            return True

    def _release_slot(self) -> None:
        assert self._free is not None
        while self._slot_waiters:
            fut = self._slot_waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    def release_slot(self, call: Call) -> None:
        if call.holds_slot:
            call.holds_slot = False
            self._release_slot()
