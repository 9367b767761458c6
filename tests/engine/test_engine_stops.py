"""Stops end to end: stop strings and ids, min_tokens, and stops found while the next step runs."""

from __future__ import annotations

from streamsd import LLM, SamplingParams
from streamsd.request import FinishReason
from tests.engine.engine_helpers import PROMPTS, assert_free, greedy_params


def test_stop_string_spanning_tokens(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), speculative_method="ngram")
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    texts = [t.text for t in base.tokens]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(3, len(texts) - 1) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 1)
    stop = texts[i][-2:] + texts[i + 1][:1]
    cut = base.text.index(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    o = out[0].outputs[0]
    assert o.text == base.text[:cut]
    assert o.finish_reason == FinishReason.STOP
    assert "".join(t.text for t in o.tokens) == o.text
    assert_free(llm)


def test_stop_token_ids_min_tokens_and_eos(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    # min_tokens makes the stop id impossible before it, so the text changes but respects it.
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in out.token_ids[: first + 2]


def test_pipelined_steps_match_sequential_steps_with_stop_strings(tiny_model_dir, close_draft_dir):
    """EngineCore.run detokenises step N while step N+1 runs: a request that hits a stop string is
    then still in the running step. Its extra tokens must vanish and every output must equal what
    one-step-at-a-time gives, with nothing leaked."""
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3)
    bases = llm.generate(PROMPTS, greedy_params())
    params = []
    for base, p in zip(bases, greedy_params(), strict=True):
        text = base.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2] if len(text) > 6 else None
        params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True,
                                     stop=[stop] if stop and stop.strip() else None))
    assert sum(p.stop is not None for p in params) >= 3

    def collect(step_outputs) -> dict:
        got: dict[str, list] = {}
        for outputs in step_outputs:
            for o in outputs:
                g = got.setdefault(o.request_id, ["", [], None, 0])
                g[0] += o.text
                g[1] += o.token_ids
                if o.finished:
                    g[2], g[3] = o.finish_reason, o.completion_tokens
                    g.append("finished")
        return got

    def submit(tag: str) -> None:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            llm.core.add_request(f"{tag}{i}", llm.core.text.encode_prompt(prompt), p)

    submit("s")
    sequential = []
    while llm.core.has_work:
        sequential.append(llm.core.step())
    assert_free(llm)
    submit("p")
    settled: list = []
    real_settle = llm.core.settle

    def counting_settle() -> list:
        outs = real_settle()
        settled.extend(outs)
        return outs

    llm.core.settle = counting_settle
    pipelined = collect(turn.outputs for turn in llm.core.run())
    assert settled, "no stop string was found under a running step: the deferred path went untested"
    assert_free(llm)
    sequential = collect(sequential)
    stopped = 0
    for i in range(len(PROMPTS)):
        s, p = sequential[f"s{i}"], pipelined[f"p{i}"]
        assert p == s and s[-1] == "finished"  # one finished output each, same text, ids and counts
        assert s[3] == len(s[1])
        stopped += s[2] == "stop"
    assert stopped >= 3


def test_a_step_failing_under_a_deferred_stop_ends_each_request_once(tiny_model_dir):
    """A stop string found while step N+1 runs, and step N+1 then fails: the stopped request keeps its
    stop (one final output), the others of that step fail, nothing leaks."""
    import time

    llm = LLM(str(tiny_model_dir))
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 2]
    core = llm.core
    real = core.rt.worker.step

    def failing_after_a_stop(plan):
        res = real(plan)
        time.sleep(0.05)  # the loop thread detokenises the previous step meanwhile
        if core._stopped:
            raise RuntimeError("injected fault")
        return res

    core.rt.worker.step = failing_after_a_stop
    core.add_request("stopper", core.text.encode_prompt(PROMPTS[1]),
                     SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    core.add_request("bystander", core.text.encode_prompt(PROMPTS[0]),
                     SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    finals: dict[str, list[str]] = {}
    for turn in core.run():
        for o in turn.outputs:
            if o.finished:
                finals.setdefault(o.request_id, []).append(o.finish_reason)
    assert finals == {"stopper": ["stop"], "bystander": ["error"]}
    assert_free(llm)
