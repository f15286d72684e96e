"""The end of a stop's drain time: a request waiting on vLLM ends then with ``ShuttingDown``, not at an event
that may come after the server has cut its connection, also when the event loop stalled past both deadlines; a
client's own hang-up stays a cancel."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import uvicorn

from app.__main__ import DrainingServer
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
    cutoff.arm(0.05)
    await asyncio.sleep(0.049)  # a timer may fire a little ahead of the deadline (uvloop rounds to 1 ms)
    cutoff.cut()
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(task, 5)
    assert seen == [0, 1] and closed == ["events closed"]
    assert not task.cancelled() and cutoff.over()


async def test_a_loop_stalled_past_the_drain_time_still_ends_a_stream_with_shutting_down_before_the_servers_cut():
    """Both deadlines timed from the signal ran in one turn after a stall (a CPU vLLM keeps busy): the server
    cancelled the request before it could send its terminal event. The server's cut now follows ours."""
    cutoff, closed = Cutoff(), []
    app = SimpleNamespace(state=SimpleNamespace(services=SimpleNamespace(traffic=SimpleNamespace(cutoff=cutoff))))
    server = DrainingServer(uvicorn.Config(app), app, drain_s=0.4, logs=None)  # type: ignore[arg-type]
    sent = []

    async def consume() -> None:
        try:
            async for _ in cutoff.guard(stalled(closed)):
                pass
        except ShuttingDown:
            await asyncio.sleep(0.03)  # the terminal event goes out: a write, the connection's close
            sent.append("terminal event")
            raise

    request = asyncio.create_task(consume())
    server.server_state.tasks.add(request)
    await asyncio.sleep(0.01)
    server.handle_exit(15, None)
    ending = asyncio.create_task(server._end_what_still_runs())
    await asyncio.sleep(0.01)
    time.sleep(0.6)  # the loop stalls past the drain time and past the server's cut
    await asyncio.wait_for(ending, 5)
    assert request.done() and not request.cancelled() and isinstance(request.exception(), ShuttingDown)
    assert sent == ["terminal event"] and closed == ["events closed"]


async def test_events_flow_before_the_deadline_and_none_is_read_after_it():
    async def numbers(read: list[int]):
        for number in range(3):
            read.append(number)
            yield number

    stopping, read = Cutoff(), []
    stopping.arm(3600)
    assert 3599 < stopping.seconds_left() <= 3600
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


async def test_a_request_queued_for_admission_ends_with_shutting_down_when_the_drain_time_is_over():
    from app.runtime.traffic import LiveTraffic

    traffic = LiveTraffic(max_in_flight=1, max_queued=4)
    holding, release = asyncio.Event(), asyncio.Event()

    async def admitted() -> None:
        async with traffic.slot():
            holding.set()
            await release.wait()  # an answer still streaming when the drain ends

    async def queued() -> None:
        async with traffic.slot():
            pytest.fail("admitted after the drain time was over")

    first = asyncio.create_task(admitted())
    await holding.wait()
    second = asyncio.create_task(queued())
    await asyncio.sleep(0.05)
    assert traffic.present == 2 and not second.done()  # waiting for the place the first one holds
    traffic.cutoff.arm(0.0)
    traffic.cutoff.cut()
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(second, 1.0)  # before: waited for the place (or the server's cut), no status
    assert traffic.present == 1
    release.set()
    await first
    assert traffic.present == 0 and traffic.running == 0
