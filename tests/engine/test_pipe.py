"""The pipe between a server and its engine process carries whole messages both ways, however large,
under either event loop (engine/process_messages.py `watch`)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from streamsd.engine.process_messages import watch

BIG = bytes(range(256)) * 16384  # 4 MiB: many times a socket's buffer, so no send or recv of it is one write or read

Runner = Callable[[Coroutine[Any, Any, None]], None]


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_watched_pipe_sends_and_reads_messages_larger_than_its_buffer(run: Runner):
    ours, theirs = mp.Pipe()
    got: list[bytes] = []
    peer_got: list[bytes] = []

    def peer() -> None:  # writes two big messages at once, reads ours only later
        writer = threading.Thread(target=lambda: (theirs.send(BIG), theirs.send(BIG)))
        writer.start()
        time.sleep(0.2)
        peer_got.append(theirs.recv())
        writer.join()

    async def main() -> None:
        done = asyncio.Event()

        def read() -> None:
            while ours.poll():
                got.append(ours.recv())  # each arrives in pieces: a recv waits for the rest
            if len(got) == 2:
                done.set()

        watch(ours, read)
        thread = threading.Thread(target=peer)
        thread.start()
        ours.send(BIG)  # the peer is not reading yet: the send waits for room instead of failing halfway
        await asyncio.wait_for(done.wait(), 10)
        asyncio.get_running_loop().remove_reader(ours.fileno())
        await asyncio.to_thread(thread.join)

    try:
        run(main())
    finally:
        ours.close()
        theirs.close()
    assert got == [BIG, BIG]
    assert peer_got == [BIG]
