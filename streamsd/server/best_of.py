"""`best_of` on /v1/completions: each prompt is sampled `best_of` times and answered with the `n`
candidates of highest cumulative logprob, best first, as vLLM does.

A candidate's cumulative logprob is the sum of the logprobs `logprobs` reports for its tokens: the
target's distribution before temperature, top-k/top-p/min-p warp it (after logit_bias and
penalties), so the ranking asks which answer the model itself finds likeliest, whatever was
sampled. Candidates run as `n` samples do (choices.py: seeds `seed + j`, the prompt prefilled
once), so candidate j is the answer `n = best_of` gives at index j. Ranking needs every candidate
finished: a streamed request with `best_of > n` is refused. Usage counts every candidate's tokens,
as OpenAI bills them.
"""

from __future__ import annotations

import dataclasses

from streamsd.engine.core import RequestOutput
from streamsd.request import SamplingParams
from streamsd.server.choices import Fanout
from streamsd.server.state import ApiError

MAX_BEST_OF = 20


def check_best_of(n: int, best_of: int | None, stream: bool) -> int:
    """The candidates to sample per prompt."""
    if best_of is None:
        return n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > MAX_BEST_OF:
        raise ApiError(400, f"best_of must be at most {MAX_BEST_OF}, got {best_of}", param="best_of")
    if stream and best_of > n:
        raise ApiError(400, "best_of > n ranks finished candidates: it cannot be streamed", param="best_of")
    return best_of


def ranked_params(params: SamplingParams, n: int, candidates: int) -> SamplingParams:
    """What each candidate samples with: the request's own params, with its tokens' logprobs kept
    for the ranking when there is one."""
    if candidates == n or params.logprobs is not None:
        return params
    return dataclasses.replace(params, logprobs=0)


def cumulative_logprob(outs: list[RequestOutput]) -> float:
    return sum(t.logprob or 0.0 for o in outs for t in o.tokens)


def pick_best(fanout: Fanout, outs: list[RequestOutput], n: int) -> tuple[Fanout, list[RequestOutput]]:
    """The n best candidates of each prompt, best first, as a fanout of n per prompt, and their outputs."""
    mine: dict[str, list[RequestOutput]] = {rid: [] for rid in fanout.rids}
    for o in outs:
        mine[o.request_id].append(o)
    chosen: list[str] = []
    for first in range(0, len(fanout.rids), fanout.n):
        candidates = fanout.rids[first : first + fanout.n]
        # sorted() is stable: among equally likely candidates the lower index wins.
        chosen += sorted(candidates, key=lambda rid: -cumulative_logprob(mine[rid]))[:n]
    return Fanout(chosen, fanout.queue, n, []), [o for rid in chosen for o in mine[rid]]
