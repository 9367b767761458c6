"""Work on behalf of an HTTP client that stops the moment the client hangs up.

A non-streaming answer is computed while nobody reads the socket; without watching it, a client
that timed out or closed would leave its request generating to the end, holding KV blocks and
batch slots. uvicorn reports the hang-up as `http.disconnect` on the receive channel once the body
is read; the work is cancelled then, and cancelling an engine stream aborts its request at the next
step (EngineClient.stream). Streaming responses need none of this: Starlette's StreamingResponse
watches the channel itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Receive

T = TypeVar("T")


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or ClientDisconnect once the client is gone (`work` cancelled by then)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cleanup (the engine abort) has run when this returns
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()
