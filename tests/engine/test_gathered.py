"""A stream that fell behind its engine reads the deltas waiting for it as one per request."""

from __future__ import annotations

import asyncio

from streamsd.engine.client import gathered
from streamsd.engine.core import RequestOutput
from streamsd.engine.detokenizer import TokenInfo


def _delta(rid: str, tok: int, text: str, *, finished: bool = False, drafted: int = 0, queued: float | None = None
           ) -> RequestOutput:
    return RequestOutput(rid, [tok], text, [TokenInfo(tok, text, drafted > 0)], finished=finished,
                         step_drafted=drafted, step_accepted=drafted, queue_seconds=queued)


def test_waiting_deltas_are_joined_per_request_in_order():
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    for out in (_delta("b", 5, "x", queued=0.25), _delta("a", 2, "c", drafted=2),
                _delta("b", 6, "y", finished=True), _delta("a", 3, "d", drafted=1)):
        queue.put_nowait(out)
    first = _delta("a", 1, "b", queued=0.5)
    outs = gathered(first, queue)
    assert queue.empty()
    assert [o.request_id for o in outs] == ["a", "b"]
    a, b = outs
    assert (a.token_ids, a.text, a.step_drafted, a.step_accepted, a.queue_seconds) == ([1, 2, 3], "bcd", 3, 3, 0.5)
    assert [t.draft for t in a.tokens] == [False, True, True] and not a.finished
    assert (b.token_ids, b.text, b.finished, b.queue_seconds) == ([5, 6], "xy", True, 0.25)


def test_a_stream_that_kept_up_reads_its_delta_as_it_came():
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    first = _delta("a", 1, "b")
    assert gathered(first, queue) == [first]
