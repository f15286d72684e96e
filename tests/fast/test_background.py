"""Background work beside users: with no user present it runs; with users present it runs only within its share
and while vLLM's last reading showed room, and is aborted when a reading shows vLLM queueing (then runs again
when there is room). The readings are given as ``EngineQueue`` gives them; the real-vLLM twin is in
tests/vllm/test_prewarm.py (re-warm under steady traffic)."""

from __future__ import annotations

import asyncio

from app.runtime.background import Background
from app.runtime.traffic import AutoLimit, LiveTraffic


class Requests:
    """Background requests that run until released, counting their starts and their aborts."""

    def __init__(self) -> None:
        self.started = self.aborted = 0
        self.release = asyncio.Event()

    async def one(self) -> str:
        self.started += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        return "done"


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def auto() -> LiveTraffic:
    return LiveTraffic(4, 0, AutoLimit(low=4, high=100, fresh_s=60))


async def test_with_users_present_background_runs_only_while_vllm_has_room_and_within_its_share():
    traffic, requests, user_leaves = auto(), Requests(), asyncio.Event()
    background = Background(traffic, beside_users=1, concurrency=2)

    async def user() -> None:
        async with traffic.slot():
            await user_leaves.wait()

    users = asyncio.create_task(user())
    await settle()
    first, second = (asyncio.create_task(background.yielding(requests.one)) for _ in range(2))
    await settle()
    assert requests.started == 0, "no reading of vLLM's queue yet: no room known"
    traffic.engine_queue(0)  # vLLM runs everything it is sent
    await settle()
    assert requests.started == 1 and background.beside == 1, "one beside the user: its share"
    traffic.engine_queue(3)  # vLLM queues: the one beside users gives way
    await settle()
    assert requests.aborted == 1 and traffic.yields == 1 and background.beside == 0
    traffic.engine_queue(0)
    await settle()
    assert requests.started == 2 and background.beside == 1, "room again: sent again, still one at a time"
    user_leaves.set()  # no user left: the other one runs too
    await users
    await settle()
    assert requests.started == 3
    requests.release.set()
    assert await asyncio.gather(first, second) == ["done", "done"]


async def test_without_a_share_or_a_reading_background_waits_for_users_to_leave_and_gives_way_when_one_comes():
    for background, reading in ((Background(auto(), beside_users=0), True), (Background(LiveTraffic(4, 0), 1), False)):
        traffic, requests = background.traffic, Requests()
        task = asyncio.create_task(background.yielding(requests.one))
        await settle()
        assert requests.started == 1  # nobody present: it runs
        async with traffic.slot():  # a user arrives
            if reading:
                traffic.engine_queue(0)  # room in vLLM, but no share beside users
            await settle()
            assert requests.aborted == 1 and requests.started == 1
        await settle()
        assert requests.started == 2
        requests.release.set()
        assert await task == "done"
