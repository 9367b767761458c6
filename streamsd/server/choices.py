"""Several answers to one HTTP request: n samples of each of its prompts, each an engine request of
its own (its own drafts, its own seed stream), answered together under one id.

Choice `index` is prompt i's sample j at i * n + j, as vLLM numbers them. Sample j of a seeded
request runs with `seed + j`, so each sample is reproducible on its own and differs from its
siblings; unseeded samples draw their seeds independently. A prompt's samples share its full KV
blocks through the prefix cache: sample 0 prefills it, the others start after its cached blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from streamsd.engine.client import EngineClient, gathered
from streamsd.engine.core import RequestOutput
from streamsd.request import SamplingParams, SpecStats
from streamsd.server.protocol import MAX_N
from streamsd.server.state import ApiError, admit

SEED_SPACE = 2**63


@dataclass(slots=True)
class Fanout:
    """The engine requests behind one HTTP request, by choice index, and the outputs they made
    while the request was being admitted."""

    rids: list[str]
    queue: asyncio.Queue[RequestOutput]
    n: int
    early: list[RequestOutput]

    def index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.rids)}

    async def outputs(self, engine: EngineClient) -> AsyncGenerator[RequestOutput]:
        """Every answer's deltas as they come, until all have finished; leaving early aborts
        those still running."""
        running = set(self.rids)
        try:
            for out in self.early:
                if out.finished:
                    running.discard(out.request_id)
                yield out
            while running:
                for out in gathered(await self.queue.get(), self.queue):
                    if out.finished:
                        running.discard(out.request_id)
                    yield out
        finally:
            for rid in running:
                engine.abort(rid)


def check_choices(n: int, candidates: int, prompts: int) -> None:
    """`candidates`: the samples per prompt (`best_of`, which is `n` unless larger: best_of.py)."""
    if prompts * candidates > MAX_N:
        what = f"n={n}" if candidates == n else f"best_of={candidates}"
        raise ApiError(400, f"{prompts} prompts x {what} asks for more than {MAX_N} answers",
                       param=("n" if candidates == n else "best_of") if candidates > 1 else "prompt")


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    if params.seed is None or j == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % SEED_SPACE)


async def admit_all(engine: EngineClient, prompts: list[list[int]], params: SamplingParams, n: int,
                    param: str) -> Fanout:
    """Admits every prompt's n samples, or none: a refusal (or the client leaving meanwhile) aborts
    those already admitted. A prompt with full blocks to share is prefilled once: its sample 0 runs
    first, and the others are admitted once it has made its first token, its blocks in the cache."""
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    rids: list[str | None] = [None] * (len(prompts) * n)
    early: list[RequestOutput] = []
    # A sample scoring its prompt computes it whole (no prefix-cache hits): nothing to wait for.
    shares = engine.info.enable_prefix_caching and n > 1 and params.prompt_logprobs is None
    block = engine.info.block_size

    def admit_sample(i: int, j: int) -> None:
        rids[i * n + j] = admit(engine, prompts[i], sample_params(params, j), param=param, queue=queue)[0]

    try:
        waiting: dict[str, int] = {}
        for i, ids in enumerate(prompts):
            admit_sample(i, 0)
            if shares and len(ids) > block:
                waiting[rids[i * n] or ""] = i
            else:
                for j in range(1, n):
                    admit_sample(i, j)
        while waiting:
            out = await queue.get()
            early.append(out)
            i = waiting.pop(out.request_id, -1)
            for j in range(1, n) if i >= 0 else ():
                admit_sample(i, j)
    except BaseException:
        for rid in rids:
            if rid is not None:
                engine.abort(rid)
        raise
    return Fanout([rid for rid in rids if rid is not None], queue, n, early)


def summed(finals: list[RequestOutput], n: int) -> RequestOutput:
    """One final output whose usage covers all answers: each prompt counted once, as OpenAI does."""
    firsts = finals[::n]
    stats = SpecStats()
    for f in finals:
        s = f.stats or SpecStats()
        stats.steps += s.steps
        stats.drafted += s.drafted
        stats.accepted += s.accepted
        stats.emitted += s.emitted
        stats.accepted_per_pos = _add(stats.accepted_per_pos, s.accepted_per_pos)
        stats.drafted_per_pos = _add(stats.drafted_per_pos, s.drafted_per_pos)
    return RequestOutput(finals[0].request_id, [], "", [], finished=True,
                         prompt_tokens=sum(f.prompt_tokens for f in firsts),
                         cached_tokens=sum(f.cached_tokens for f in firsts),
                         completion_tokens=sum(f.completion_tokens for f in finals), stats=stats)


def _add(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)), strict=True)]
