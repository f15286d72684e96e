"""The serving process's line to one worker process: pickled messages, each prefixed by its length, over a
socket pair. The serving end is read and written by the event loop itself (asyncio streams), so no thread
hands a message over and none waits for the GIL; the worker's end is a plain blocking loop. One exchange at a
time: a message, then its answer."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import pickle
import socket
import struct
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

Message = tuple[str, dict[str, tuple[int, int]], Any]  # (kind, per collection: its reloads and writes; payload)
HEADER = struct.Struct("!I")  # a message's length in bytes
STOP_S = 10.0  # a worker still alive this long after its channel closed is terminated


class ChannelClosed(Exception):
    """The worker's end is gone: it died (killed, out of memory) or the channel was closed."""


class Channel:
    def __init__(self, process: BaseProcess, sock: socket.socket) -> None:
        self.process, self._sock = process, sock
        self.closed = False
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def spawn(cls, target: Callable[..., None], *args: Any) -> Channel:
        """``target(*args, its_end)`` in a new process (spawned, not forked: the serving process has threads)."""
        ours, theirs = socket.socketpair()
        process = multiprocessing.get_context("spawn").Process(target=target, args=(*args, theirs), daemon=True,
                                                               name="prefixrag-retrieval")
        process.start()
        theirs.close()  # the worker's copy only: its death is then an end of file here
        return cls(process, ours)

    async def exchange(self, message: Message) -> Any:
        """Send ``message``, return the worker's answer. A caller cancelled meanwhile leaves the exchange to
        finish, so that the next one reads its own answer."""
        exchange = asyncio.ensure_future(self._exchange(message))
        exchange.add_done_callback(_retrieved)
        return await asyncio.shield(exchange)

    async def _exchange(self, message: Message) -> Any:
        async with self._lock:
            if self.closed:
                raise ChannelClosed("the worker's channel is closed")
            try:
                if self._streams is None:
                    self._streams = await asyncio.open_connection(sock=self._sock)
                reader, writer = self._streams
                payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
                writer.write(HEADER.pack(len(payload)) + payload)
                await writer.drain()
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                return pickle.loads(await reader.readexactly(size))
            except (OSError, asyncio.IncompleteReadError) as exc:
                self.closed = True
                raise ChannelClosed(f"the worker (pid {self.process.pid}) is gone: {exc!r}") from exc

    async def aclose(self) -> None:
        """Close the channel: the worker ends at its next read; it is terminated if it has not after ``STOP_S``."""
        self.closed = True
        if self._streams is not None:
            self._streams[1].close()
            with contextlib.suppress(OSError):
                await self._streams[1].wait_closed()
        else:
            self._sock.close()
        await asyncio.to_thread(self.process.join, STOP_S)
        if self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join, STOP_S)


def _retrieved(exchange: asyncio.Future[Any]) -> None:
    if not exchange.cancelled():
        exchange.exception()  # read, so that a caller that gave up leaves no "never retrieved" warning


def serve_channel(end: socket.socket, answer: Callable[[Message], object]) -> None:
    """The worker's loop: read a message, send ``answer(message)``, until the serving process closes its end."""
    with end, end.makefile("rb") as incoming:
        while len(header := incoming.read(HEADER.size)) == HEADER.size:
            (size,) = HEADER.unpack(header)
            payload = pickle.dumps(answer(pickle.loads(incoming.read(size))), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                end.sendall(HEADER.pack(len(payload)) + payload)
            except (BrokenPipeError, ConnectionResetError):
                return
