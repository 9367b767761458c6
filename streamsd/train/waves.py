"""Driving many offline requests through the engine in waves (train-draft's data generation)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import Any

from streamsd.request import SamplingParams


def in_waves(core: Any, requests: list[tuple[str, list[int], SamplingParams]], deadline: float | None = None,
             on_deadline: Callable[[int], None] | None = None) -> Iterator[Any]:
    """Every output of `requests` (id, prompt ids, params) through the engine, admitted a quarter of
    the batch at a time.

    Only decode steps replay CUDA graphs; a step that carries a new request's prompt chunk runs
    eagerly. Admitting each request the moment another finishes (what a server must do) puts a
    prompt chunk into a large share of the steps of a long offline run with answers of mixed lengths
    (25 % of the steps at batch 64 on the CPU); in waves, all but a few steps per wave are graph
    replays. At `deadline` (time.monotonic()) the running requests are aborted, the rest dropped.
    """
    cap = core.scheduler.cfg.max_num_seqs
    wave = max(1, cap // 4)
    pending = collections.deque(requests)
    live: set[str] = set()
    while pending or core.has_work:
        if deadline is not None and time.monotonic() > deadline:
            for rid in live:
                core.abort(rid)  # finalised by the next step's schedule
            if on_deadline:
                on_deadline(len(live) + len(pending))
            pending.clear()
            deadline = None
        if pending and len(live) <= cap - wave:
            while pending and len(live) < cap:
                rid, ids, params = pending.popleft()
                core.add_request(rid, ids, params)
                live.add(rid)
        for out in core.step():
            if out.finished:
                live.discard(out.request_id)
            yield out
