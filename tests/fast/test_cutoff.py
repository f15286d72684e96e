"""The end of a stop's drain time: a request waiting on vLLM ends then with ``ShuttingDown``, not at an event
that may come after uvicorn has cut its connection; a client's own hang-up stays a cancel."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.core.errors import ShuttingDown
from app.runtime.cutoff import Cutoff


async def stalled(closed: list[str], first: int = 0):
    """``first`` events, then a wait no event ends (a queued prefill, a starved decode step)."""
    try:
        for number in range(first):
            yield number
        await asyncio.sleep(3600)
        yield -1
    finally:
        closed.append("events closed")  # where the pipeline aborts its vLLM request


async def test_a_request_waiting_on_vllm_ends_with_shutting_down_when_the_drain_time_is_over():
    cutoff, closed, seen = Cutoff(), [], []

    async def consume() -> None:
        async for event in cutoff.guard(stalled(closed, first=2)):
            seen.append(event)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    started = time.monotonic()
    cutoff.arm(0.05)
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(task, 5)
    assert 0.04 <= time.monotonic() - started < 1.0
    assert seen == [0, 1] and closed == ["events closed"]
    assert not task.cancelled() and cutoff.over()


async def test_events_flow_before_the_deadline_and_none_is_read_after_it():
    async def numbers(read: list[int]):
        for number in range(3):
            read.append(number)
            yield number

    stopping, read = Cutoff(), []
    stopping.arm(3600)
    assert [event async for event in stopping.guard(numbers(read))] == [0, 1, 2]
    over, read = Cutoff(), []
    over.arm(0)
    with pytest.raises(ShuttingDown):
        async for _ in over.guard(numbers(read)):
            pass
    assert read == []


async def test_a_clients_hang_up_stays_a_cancel_and_is_not_taken_for_the_cut():
    cutoff, closed = Cutoff(), []

    async def consume() -> None:
        async for _ in cutoff.guard(stalled(closed)):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    cutoff.arm(3600)  # stopping, but the drain time is far from over
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and closed == ["events closed"]
