"""Admission with ``max_in_flight=auto``: the limit grows only while vLLM's last reading showed no queue (by the
free KV cache's worth of requests like ours, at least doubling), comes down to what vLLM runs once it queues; a
request beyond it waits for the next reading (bounded) unless vLLM queues, then it is refused at once."""

from __future__ import annotations

import asyncio
import contextlib
import functools

import pytest

from app.core.errors import Overloaded
from app.runtime.traffic import AutoLimit, LiveTraffic


async def hold(traffic: LiveTraffic, count: int, stack: contextlib.AsyncExitStack) -> None:
    for _ in range(count):
        await stack.enter_async_context(traffic.slot())


async def held_until(traffic: LiveTraffic, release: asyncio.Event) -> None:
    """One request that holds its place until ``release`` is set."""
    async with traffic.slot():
        await release.wait()


async def ask_as(traffic: LiveTraffic, client: str, release: asyncio.Event | None = None) -> str:
    """One request on connection ``client``: "admitted" (its place held until ``release`` is set, else given
    straight back) or "429 after N"."""
    from app.runtime.returns import CLIENT

    CLIENT.set(client)
    try:
        async with traffic.slot():
            if release is not None:
                await release.wait()
            return "admitted"
    except Overloaded as refusal:
        return f"429 after {refusal.retry_after_s}"


async def test_the_limit_grows_only_on_a_fresh_reading_that_shows_no_queue():
    traffic = LiveTraffic(2, 0, AutoLimit(low=2, high=100, fresh_s=60))
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 2, stack)
        with pytest.raises(Overloaded):  # vLLM's queue not read yet: the floor holds
            await stack.enter_async_context(traffic.slot())
        traffic.engine_queue(0)  # vLLM runs all it is sent: up to twice the limit until the next reading
        await hold(traffic, 2, stack)
        assert traffic.max_in_flight == 4
        with pytest.raises(Overloaded):
            await stack.enter_async_context(traffic.slot())
        traffic.engine_queue(0)
        await hold(traffic, 4, stack)
        assert traffic.max_in_flight == traffic.running == 8 and traffic.refused == 2


async def test_a_queue_in_vllm_brings_the_limit_down_to_what_it_runs_and_stops_growth():
    traffic = LiveTraffic(2, 0, AutoLimit(low=2, high=100, fresh_s=60))
    async with contextlib.AsyncExitStack() as stack:
        traffic.engine_queue(0)
        await hold(traffic, 4, stack)
        traffic.engine_queue(0)
        await hold(traffic, 4, stack)
        traffic.engine_queue(3)  # 3 of our 8 wait inside vLLM: it runs 5
        assert traffic.max_in_flight == 5
        with pytest.raises(Overloaded):
            await stack.enter_async_context(traffic.slot())
    assert traffic.running == traffic.present == 0


async def test_a_stale_reading_does_not_let_the_limit_grow():
    traffic = LiveTraffic(1, 0, AutoLimit(low=1, high=100, fresh_s=0.05))
    traffic.engine_queue(0)
    await asyncio.sleep(0.1)
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 1, stack)
        with pytest.raises(Overloaded):
            await stack.enter_async_context(traffic.slot())


async def test_a_fixed_limit_ignores_vllms_queue_and_queued_requests_get_the_places_freed():
    traffic = LiveTraffic(1, 1)
    traffic.engine_queue(0)
    order = []

    async def request(name: str, seconds: float) -> None:
        async with traffic.slot():
            order.append(name)
            await asyncio.sleep(seconds)

    first = asyncio.create_task(request("first", 0.1))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(request("second", 0))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):  # one in flight, one queued: the third is refused at once
        async with traffic.slot():
            pass
    await asyncio.gather(first, second)
    assert order == ["first", "second"] and traffic.max_in_flight == 1 and traffic.running == 0


async def test_a_queued_request_cancelled_while_it_waits_neither_keeps_nor_loses_a_place():
    traffic = LiveTraffic(1, 1, AutoLimit(low=1, high=10, fresh_s=60))
    release = asyncio.Event()
    holder = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.01)
    gone = asyncio.create_task(held_until(traffic, release))  # queued behind the holder
    await asyncio.sleep(0.01)
    gone.cancel()  # its wait is cancelled; the task itself has not run again yet
    traffic.engine_queue(0)
    async with traffic.slot():  # the limit grows at once: the freed place must not go to the cancelled one
        assert traffic.running == 2
    release.set()
    await holder
    with contextlib.suppress(asyncio.CancelledError):
        await gone
    assert traffic.running == traffic.present == 0 and not traffic._waiting


async def test_a_burst_beyond_the_limit_waits_for_the_next_reading_instead_of_being_refused():
    traffic = LiveTraffic(2, 0, AutoLimit(low=2, high=100, fresh_s=60, wait_s=5))
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 2, stack)
        burst = [asyncio.create_task(hold(traffic, 1, stack)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in burst)  # waiting for vLLM's queue to be read, not refused
        traffic.engine_queue(0, kv_usage=0.2)  # two of ours use a fifth of the cache: room for eight more
        await asyncio.gather(*burst)
        assert traffic.running == 5 and traffic.refused == 0
        await hold(traffic, 5, stack)  # still within what the reading allowed
        assert traffic.max_in_flight == 10


async def test_while_vllm_queues_a_request_beyond_the_limit_is_refused_at_once():
    traffic = LiveTraffic(2, 0, AutoLimit(low=2, high=100, fresh_s=60, wait_s=30))
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 2, stack)
        traffic.engine_queue(1)
        with pytest.raises(Overloaded):
            await asyncio.wait_for(stack.enter_async_context(traffic.slot()), 1)


async def test_the_wait_for_a_reading_is_bounded_and_a_freed_place_ends_it():
    traffic = LiveTraffic(1, 0, AutoLimit(low=1, high=100, fresh_s=60, wait_s=0.1))
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 1, stack)
        with pytest.raises(Overloaded):  # no reading came
            await stack.enter_async_context(traffic.slot())
    traffic = LiveTraffic(1, 0, AutoLimit(low=1, high=100, fresh_s=60, wait_s=30))
    release = asyncio.Event()
    first = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.01)
    release.set()  # the first leaves: the second takes its place without any reading
    await asyncio.wait_for(asyncio.gather(first, second), 1)
    assert traffic.refused == 0 and traffic.max_in_flight == 1


async def test_soon_after_vllm_queued_a_request_beyond_the_limit_is_refused_at_once_and_the_edge_says_so():
    traffic = LiveTraffic(2, 0, AutoLimit(low=2, high=100, fresh_s=60, wait_s=30, full_s=60))
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 2, stack)
        assert traffic.refuses_now() is None  # at the limit, vLLM never seen queueing: it would wait for a reading
        traffic.engine_queue(1)
        traffic.engine_queue(0, kv_usage=0.99)  # vLLM's queue emptied: the limit may double, no more
        await hold(traffic, 2, stack)
        with pytest.raises(Overloaded):  # not after wait_s: vLLM was full a moment ago
            await asyncio.wait_for(stack.enter_async_context(traffic.slot()), 1)
        refusal = traffic.refuses_now()
        assert refusal is not None and refusal.retry_after_s >= 1 and traffic.refused == 2


async def test_after_a_refusal_the_next_request_beyond_the_limit_is_refused_at_once_not_after_the_wait():
    traffic = LiveTraffic(1, 0, AutoLimit(low=1, high=100, fresh_s=60, wait_s=0.3, full_s=60))
    async with contextlib.AsyncExitStack() as stack:
        await hold(traffic, 1, stack)
        started = asyncio.get_running_loop().time()
        with pytest.raises(Overloaded):  # a burst after a quiet spell: it waited for a reading that never came
            await stack.enter_async_context(traffic.slot())
        waited = asyncio.get_running_loop().time() - started
        with pytest.raises(Overloaded):  # the load is sustained: refused at once
            await asyncio.wait_for(stack.enter_async_context(traffic.slot()), 0.1)
        assert waited >= 0.3 and traffic.refuses_now() is not None and traffic.refused == 3


async def test_a_client_that_comes_back_when_told_waits_for_the_next_place_and_one_that_storms_is_refused():
    traffic, release = LiveTraffic(1, 0), asyncio.Event()
    holder = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.01)
    ask = functools.partial(ask_as, traffic)

    async def storm(client: str, until: float) -> list[str]:
        seen = []
        while asyncio.get_running_loop().time() < until:
            seen.append(await ask(client))
            await asyncio.sleep(0.05)  # never waits its Retry-After
        return seen

    assert await ask("10.0.0.1:1") == "429 after 1" and await ask("10.0.0.2:2") == "429 after 1"
    stormed = asyncio.create_task(storm("10.0.0.2:2", asyncio.get_running_loop().time() + 1.4))
    await asyncio.sleep(1.05)  # the first client waits the second it was told
    returned = asyncio.create_task(ask("10.0.0.1:1"))
    # Early every time, the storm's time starts over: it is refused, before and after its first second was up.
    assert all(seen.startswith("429") for seen in await stormed) and not returned.done()
    release.set()  # the place freed goes to the client that waited, not to whoever asks first
    assert await returned == "admitted"
    await holder


async def test_a_client_admitted_after_a_refusal_is_not_taken_later_for_one_returning_when_told():
    """A storm's client that got a place as one freed, asking again once its old Retry-After is past, is refused at
    once like the rest of the storm: it did not wait as told, so it may not wait ahead of those that did."""
    traffic = LiveTraffic(1, 0)
    ask = functools.partial(ask_as, traffic)
    first, answered, last = asyncio.Event(), asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(held_until(traffic, first))
    await asyncio.sleep(0.01)
    assert (await ask("10.0.0.2:2")).startswith("429")  # told to come back in a second
    first.set()
    await holder
    admitted = asyncio.create_task(ask("10.0.0.2:2", answered))  # asks again at once: the place is free
    await asyncio.sleep(1.05)  # its answer takes longer than it was told to wait
    answered.set()
    assert await admitted == "admitted"
    holder = asyncio.create_task(held_until(traffic, last))
    await asyncio.sleep(0.01)
    assert (await asyncio.wait_for(ask("10.0.0.2:2"), 0.5)).startswith("429")  # its next question, the service full
    last.set()
    await holder


async def test_a_client_that_came_back_early_is_refused_at_once_when_a_later_retry_lands_after_its_time():
    """A storm's client asks again at once after each 429; when its own loop lags past its Retry-After, a retry
    lands after the promised time by the clock. It did not wait as told: refused at once, not let wait for a
    place ahead of the clients that did."""
    traffic, release = LiveTraffic(1, 0), asyncio.Event()
    holder = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.01)
    ask = functools.partial(ask_as, traffic)
    assert await ask("10.0.0.2:2") == "429 after 1"  # told to come back in a second
    assert (await ask("10.0.0.2:2")).startswith("429")  # back at once
    await asyncio.sleep(1.05)  # its next retry lags past the second it was last told
    assert (await asyncio.wait_for(ask("10.0.0.2:2"), 0.5)).startswith("429")  # at once, not after a wait
    release.set()
    await holder
    assert await ask("10.0.0.2:2") == "admitted"  # a place free: admitted like anyone, its slate clean


async def test_clients_that_came_back_get_the_places_freed_in_the_order_they_came_back():
    from app.runtime.returns import CLIENT

    traffic, release = LiveTraffic(1, 0), asyncio.Event()
    holder = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.01)
    admitted = []

    async def ask(client: str) -> None:
        CLIENT.set(client)
        async with traffic.slot():
            admitted.append(client)

    for client in ("10.0.0.1:1", "10.0.0.2:2", "10.0.0.3:3"):
        with pytest.raises(Overloaded):
            await ask(client)
    await asyncio.sleep(1.05)  # the Retry-After they were told
    returns = []
    for client in ("10.0.0.2:2", "10.0.0.1:1", "10.0.0.3:3"):  # back in this order, each waiting for a place
        returns.append(asyncio.create_task(ask(client)))
        await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(holder, *returns)
    assert admitted == ["10.0.0.2:2", "10.0.0.1:1", "10.0.0.3:3"]


async def test_a_client_that_came_back_waits_about_as_long_as_requests_hold_their_places(monkeypatch):
    """Places can free in waves a service time apart (answers admitted together end together): a returning
    client's wait follows the recent service time, within its bounds, not a fixed few seconds."""
    from app.runtime import returns
    from app.runtime.returns import CLIENT

    monkeypatch.setattr(returns, "MIN_HOLD_S", 0.1)
    monkeypatch.setattr(returns, "MAX_HOLD_S", 1.0)

    async def comes_back(service_s: float, frees_after_s: float) -> tuple[str, float]:
        traffic, release = LiveTraffic(1, 0), asyncio.Event()
        holder = asyncio.create_task(held_until(traffic, release))
        await asyncio.sleep(0.01)
        CLIENT.set(f"10.0.0.1:{service_s}")
        with pytest.raises(Overloaded):
            await hold(traffic, 1, contextlib.AsyncExitStack())
        traffic.service_s = service_s
        await asyncio.sleep(1.05)  # the Retry-After it was told (1 s), then it comes back
        loop = asyncio.get_running_loop()
        loop.call_later(frees_after_s, release.set)
        started = loop.time()
        try:
            async with traffic.slot():
                seen = "admitted"
        except Overloaded:
            seen = "429"
        waited = loop.time() - started
        release.set()
        await holder
        return seen, waited

    seen, waited = await comes_back(service_s=0.6, frees_after_s=0.3)  # longer than MIN_HOLD_S: still waits
    assert seen == "admitted" and 0.25 < waited < 0.5
    seen, waited = await comes_back(service_s=60.0, frees_after_s=1.5)  # never beyond MAX_HOLD_S
    assert seen == "429" and 0.95 < waited < 1.3


async def test_a_request_waiting_beyond_the_limit_has_vllms_queue_read_at_once_not_at_the_intervals_end():
    """A burst grows the limit a step per reading: each step must not wait out the load interval."""
    from app.runtime.capacity import EngineQueue
    from app.runtime.upstream import Upstream
    from tests.support.fakes import FakeVLLM

    class CountedReads(FakeVLLM):
        reads = 0

        async def metrics_text(self, replica: str | None = None) -> str:
            self.reads += 1
            return await super().metrics_text(replica)

    llm = CountedReads()
    traffic = LiveTraffic(2, 0, AutoLimit(low=2, high=100, fresh_s=60, wait_s=30))
    reader = asyncio.create_task(EngineQueue(traffic, Upstream(llm, llm.settings), interval_s=5).run_forever())
    try:
        async with contextlib.AsyncExitStack() as stack:
            await hold(traffic, 2, stack)  # users present: the first reading comes at once
            await asyncio.sleep(0.05)
            assert llm.reads == 1
            await asyncio.wait_for(hold(traffic, 6, stack), 2)  # 2 by that reading, 4 by one asked for at once
            assert traffic.max_in_flight == traffic.running == 8 and traffic.refused == 0 and llm.reads == 2
    finally:
        reader.cancel()


async def test_a_client_that_came_back_waits_while_places_free_beyond_one_service_time(monkeypatch):
    """vLLM queues, and the limit comes down to what it runs: those running beyond it end before any place is
    given. A client that came back when told waits while they end (places keep being freed), not one service
    time; with none freed for a service time it is refused."""
    from app.runtime import returns

    monkeypatch.setattr(returns, "MIN_HOLD_S", 0.1)
    traffic = LiveTraffic(4, 0, AutoLimit(low=1, high=100, fresh_s=60))
    async with traffic.slot():  # one answer has ended: the service time is the average, set below
        pass
    releases = [asyncio.Event() for _ in range(5)]
    holders = [asyncio.create_task(held_until(traffic, release)) for release in releases[:4]]
    await asyncio.sleep(0.01)
    traffic.engine_queue(3)  # vLLM runs one of our four: the limit comes down to 1, three beyond it
    traffic.service_s = 0.2
    ask = functools.partial(ask_as, traffic, "10.0.0.1:1")
    assert await ask() == "429 after 1"
    await asyncio.sleep(1.05)  # as told
    returned = asyncio.create_task(ask(releases[4]))
    for release in releases[:4]:  # they end 0.15 s apart: the place comes after 0.6 s, three service times
        await asyncio.sleep(0.15)
        release.set()
    await asyncio.sleep(0.05)
    assert traffic.running == 1 and not returned.done()  # admitted, holding the place
    traffic.service_s = 0.2  # as before the four long holders ended
    assert await ask() == "429 after 1"  # asked early: refused at once
    await asyncio.sleep(1.05)  # as told
    started = asyncio.get_running_loop().time()
    assert await ask() == "429 after 1"  # nothing freed within a service time (0.2 s): refused
    assert 0.15 < asyncio.get_running_loop().time() - started < 0.5
    releases[4].set()
    assert await returned == "admitted"
    await asyncio.gather(*holders)


async def test_before_any_answer_has_ended_a_returning_client_waits_as_long_as_the_first_has_held_its_place(
        monkeypatch):
    """A storm at start-up: the first answers are all still running, so the average service time is only its
    first guess (1 s); a client told to come back then would wait about that long and be refused again just before
    the first wave ends. The time the first request has held its place bounds the service time from below."""
    from app.runtime import returns
    from app.runtime.returns import CLIENT

    monkeypatch.setattr(returns, "MIN_HOLD_S", 0.1)
    traffic, release = LiveTraffic(1, 0), asyncio.Event()
    holder = asyncio.create_task(held_until(traffic, release))
    await asyncio.sleep(0.6)  # the first answer has held its place for a while, and has not ended
    CLIENT.set("10.0.0.1:1")
    with pytest.raises(Overloaded) as refused:
        await hold(traffic, 1, contextlib.AsyncExitStack())
    assert refused.value.retry_after_s == 1
    await asyncio.sleep(1.05)  # back when told: the first has held its place ~1.7 s by now
    loop = asyncio.get_running_loop()
    loop.call_later(1.3, release.set)  # longer than the average's first guess
    started = loop.time()
    async with traffic.slot():
        waited = loop.time() - started
    await holder
    assert 1.25 < waited < 1.6
    assert traffic.service_time_s() < 2.5  # once answers end, their average again
