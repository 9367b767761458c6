"""When a request reached each stage (RequestMetrics): the server's TTFT split into queue and prefill."""

from __future__ import annotations

from streamsd import LLM, SamplingParams


def test_queue_time_ends_when_a_step_takes_the_request_and_that_step_is_its_prefill(tiny_model_dir):
    """The wait ends when a plan first takes the request, before its step runs, so the step's own time
    counts as prefill (request_prefill_time_seconds), never as queueing (request_queue_time_seconds)."""
    llm = LLM(str(tiny_model_dir))
    core = llm.core
    prompt = core.encode_prompt("The quick brown fox jumps over the lazy dog")
    core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    turns = list(core.run())
    m = next(out.metrics for t in turns for out in t.outputs if out.finished)
    assert m is not None and m.first_scheduled_time is not None and m.first_token_time is not None
    first_step = next(t.execute_s for t in turns if t.plan.entries)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time - m.first_scheduled_time >= first_step
