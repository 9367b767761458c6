"""Request bodies read with their size bounded while they arrive, never after."""

from __future__ import annotations

from starlette.requests import Request

from streamsd.server.state import ApiError

MAX_BODY = 4 * 1024 * 1024


def _too_large(limit: int) -> ApiError:
    # The rest of the body is never read: the connection cannot carry another request.
    return ApiError(413, f"the request body is larger than {limit} bytes", headers={"Connection": "close"})


async def read_limited(request: Request, limit: int = MAX_BODY) -> bytes:
    """The body; a 413 as soon as its Content-Length, or the bytes counted so far, pass `limit`.
    A client hanging up mid-body raises starlette's ClientDisconnect."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
