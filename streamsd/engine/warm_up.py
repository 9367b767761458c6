"""Two short requests through the engine's own step path before the server says it is ready.

Without them the first request after a start pays for every first call on its way: on a GPU, CUDA's
lazily loaded kernel modules, cuBLAS's choice of kernels for the prompt's shapes, the draft head's
eager catch-up over a prompt (the start-up graphs cover decode and verify steps only, and a start
that reads its cost profile back from disk runs no prompt at all); on a CPU, oneDNN's primitives and
the allocator's growth. On an H200 the first chat request took 0.31 s where the tenth took 0.09 s,
and on a 2-core CPU a first prompt took twice the TTFT of the next ones.

Running the same steps once at start-up moves those costs out of every user's way: a greedy and a
seeded sampled request together, prefilled over two KV blocks and decoded with the engine's own
proposer, plain, chained or tree steps, queued-ahead steps included; then a request alone, as a first
chat request comes: once with speculation off (plain steps of one row, queued ahead) and once greedy
with it, the second prefilling past the blocks the first left cached. The requests alone take a real
chat's prompt (`chat_prompt`: the model's template around a short message) where the model has one
and it fits: a prompt step's kernels and their first-time costs depend on its length. They run under
a scheduler of their own with a fixed policy, so the engine's scheduler, prefix cache, counters and
adaptive policy never see them; the KV blocks they wrote are free again (every block is, before the
first request), and what they wrote is overwritten by whichever request is given those blocks next.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from streamsd.config import SchedulerConfig, SpecConfig
from streamsd.model.tokenizer import Tokenizer
from streamsd.policy.policy import FixedPolicy
from streamsd.request import Request, SamplingParams
from streamsd.sched.scheduler import Scheduler
from streamsd.worker.worker import Worker

PROMPT_TOKENS = 20  # past one KV block (BLOCK_SIZE 16): a prompt chunk's shape, like a short chat prompt
NEW_TOKENS = 8  # a prefill, then verify (or plain) steps with drafts from the proposer
ALONE_TOKENS = 4  # a request alone: a prefill past the cached block, then steps queued ahead


# A first chat message, repeating itself so that an n-gram proposer finds matches in it too
CHAT_MESSAGE = "Hello! Who are you? Hello! Who are you? Hello! Who are you?"


def warm_up_prompt(vocab_size: int) -> list[int]:
    """A prompt that repeats itself, so that an n-gram proposer finds matches and drafts too."""
    base = vocab_size // 2
    return [base + i % 4 for i in range(PROMPT_TOKENS)]


def _fits(prompt: list[int], cfg: SchedulerConfig, k: int) -> bool:
    """A request alone on that prompt, its drafts included, fits the context and half the KV pool."""
    need = len(prompt) + ALONE_TOKENS + 2 * (k + 1)
    return need <= min(cfg.max_model_len, cfg.num_blocks * cfg.block_size // 2)


def warm_up_chat_prompt(tokenizer: Tokenizer, template: str | None) -> list[int] | None:
    """A first chat request's prompt, for the warm-up; None where the model has no chat template."""
    if template is None and not tokenizer.chat_template:
        return None
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], chat_template=template,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True, slots=True)
class WarmUp:
    seconds: float
    steps: int
    drafted: int  # drafts the proposer made for the two requests (0 without speculation)


def warm_up(worker: Worker, cfg: SchedulerConfig, spec: SpecConfig, eos_ids: frozenset[int], q_slots: int,
            chat_prompt: list[int] | None = None) -> WarmUp:
    """Runs the warm-up's requests to their end on `worker`. Leaves no step queued and no KV block held."""
    t0 = time.perf_counter()
    # Its own queue bound: a server may admit fewer waiting requests than the two.
    sched = Scheduler(dataclasses.replace(cfg, max_queue=max(cfg.max_queue, 2)), dense_q_slots=q_slots,
                      policy=FixedPolicy(spec.max_batch))
    prompt = warm_up_prompt(worker.vocab)
    k = spec.num_tokens if spec.enabled else 0
    alone = chat_prompt if chat_prompt and _fits(chat_prompt, cfg, k) else prompt  # the requests alone take it
    # (temperature, k) of each request, a round's requests together: the pair, then alone
    rounds = [[(0.0, k), (1.0, k)], [(0.0, 0)]] + ([[(0.0, k)]] if k else [])
    steps = drafted = 0
    for r, requests in enumerate(rounds):
        for i, (temperature, spec_k) in enumerate(requests):
            params = SamplingParams(temperature=temperature, max_tokens=NEW_TOKENS if r == 0 else ALONE_TOKENS, seed=i,
                                    ignore_eos=True)
            sched.add(Request(request_id=f"warm-up-{r}-{i}", prompt_ids=list(alone if r else prompt), params=params,
                              seed=i, arrival=time.monotonic(), eos_ids=eos_ids, spec_k=spec_k,
                              greedy_draft=temperature < spec.draft_greedy_threshold))
        while sched.has_work:
            plan, _ = sched.schedule(worker.lookahead.follow)
            results = worker.step(plan) if plan.entries else []
            steps += 1
            drafted += sum(n for *_, n in sched.update(plan, results))
            worker.lookahead.forget_finished()
    assert worker.lookahead.queued is None and sched.blocks.num_free == cfg.num_blocks, "the warm-up left work behind"
    return WarmUp(time.perf_counter() - t0, steps, drafted)
