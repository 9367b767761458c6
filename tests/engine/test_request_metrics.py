"""When a request reached each stage (RequestMetrics): the server's TTFT split into queue and prefill."""

from __future__ import annotations

import asyncio
import time

from streamsd import LLM, SamplingParams
from streamsd.engine.async_engine import AsyncEngine


def test_queue_time_ends_when_a_step_takes_the_request_and_that_step_is_its_prefill(tiny_model_dir):
    """The wait ends when a plan first takes the request, before its step runs, so the step's own time
    counts as prefill (request_prefill_time_seconds), never as queueing (request_queue_time_seconds)."""
    llm = LLM(str(tiny_model_dir))
    core = llm.core
    prompt = core.text.encode_prompt("The quick brown fox jumps over the lazy dog")
    core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    turns = list(core.run())
    m = next(out.metrics for t in turns for out in t.outputs if out.finished)
    assert m is not None and m.first_scheduled_time is not None and m.first_token_time is not None
    first_step = next(t.execute_s for t in turns if t.plan.entries)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time - m.first_scheduled_time >= first_step


def test_a_step_after_the_engine_waited_for_work_is_timed_from_its_own_start(tiny_model_dir):
    """The async engine idles between two requests; the second one's first step is reported (to the
    metrics and the policy) without the wait before it."""
    async def main() -> list[tuple[float, float]]:
        llm = LLM(str(tiny_model_dir))
        engine = AsyncEngine(llm.core)
        seen: list[tuple[float, float]] = []  # (step seconds, when observed)
        engine.step_observers.append(lambda step: seen.append((step.seconds, time.perf_counter())))
        await engine.start()
        prompt = llm.core.text.encode_prompt("The quick brown fox")
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        async for _ in engine.generate(prompt, params):
            pass
        await asyncio.sleep(0.04)  # idle, under the gap a host stall is allowed
        while not seen:
            await asyncio.sleep(0.001)
        submitted = time.perf_counter()
        async for _ in engine.generate(prompt, params):
            pass
        while len(seen) < 2:
            await asyncio.sleep(0.001)
        await engine.close()
        return [(s, at - submitted) for s, at in seen[1:]]

    (seconds, since_submit), *_ = asyncio.run(main())
    assert 0.0 < seconds <= since_submit  # the step began after its request was submitted
