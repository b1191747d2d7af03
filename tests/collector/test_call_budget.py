"""The gRPC call budget on its own (no server): places per listener and per peer, read slots handed over in
order, and a stalled call (no message after ``stall_s``) ended to make room, never a call whose message came."""

from __future__ import annotations

import asyncio

import pytest

from collector_processor.receiver.call_budget import CallBudget, Evicted


def test_places_per_listener_and_per_peer_are_made_by_ending_stalled_calls_only() -> None:
    b = CallBudget(max_calls=3, max_per_peer=2, stall_s=1.0, slots=None)
    a1, a2 = b.admit("a", 0.0), b.admit("a", 0.0)
    assert a1 and a2 and b.admit("a", 0.5) is None  # the peer's two places are young
    c1 = b.admit("b", 0.5)
    assert c1 is not None and b.admit("c", 0.5) is None  # the listener is full of young calls
    b.arrived(a1)  # a1's message came: never ended to make room
    c2 = b.admit("c", 1.2)  # a2 has waited 1.2 s: ended for the newcomer
    assert c2 is not None and a2.evicted and not a1.evicted and b.evicted == 1
    b.leave(a2)  # its handler leaves later: counted once
    assert b.calls == 3
    for call in (a1, c1, c2):
        b.leave(call)
    assert b.calls == 0


def test_read_slots_go_in_order_and_a_stalled_holder_is_ended_for_a_waiter() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        b = CallBudget(max_calls=10, max_per_peer=10, stall_s=0.2, slots=1)
        holder = b.admit("a", loop.time())
        assert holder is not None and await b.slot(holder, 5.0)
        holder.task = loop.create_future()  # what the holder awaits (its read), cancelled when it is ended
        waiter = b.admit("b", loop.time())
        assert waiter is not None
        got = await b.slot(waiter, 5.0)  # no free slot: after stall_s the holder is ended and the slot is ours
        assert got and holder.evicted and holder.task.cancelled() and waiter.holds_slot
        b.arrived(waiter)
        late = b.admit("c", loop.time())
        assert late is not None
        assert not await b.slot(late, 0.3)  # the only holder has its message: nothing to end, no slot
        b.leave(waiter)
        assert await b.slot(late, 1.0)

    asyncio.run(scenario())


def test_a_call_ended_while_waiting_for_a_slot_raises_evicted() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        b = CallBudget(max_calls=1, max_per_peer=10, stall_s=0.1, slots=1)
        first = b.admit("a", loop.time())
        assert first is not None and await b.slot(first, 1.0)
        b.arrived(first)
        b.max_calls = 2
        second = b.admit("a", loop.time())
        assert second is not None
        waiting = asyncio.ensure_future(b.slot(second, 5.0))
        await asyncio.sleep(0.15)
        b.max_calls = 1
        assert b.admit("a", loop.time()) is not None  # the newcomer ends the stalled waiter
        with pytest.raises(Evicted):
            await waiting

    asyncio.run(scenario())
