"""The engine's failures and refusals: aborts, a crashing step, bad inputs; no Triton on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import PROMPTS, assert_free, greedy_params


def test_abort_and_finish_mix_frees_every_block(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), kv_cache_tokens=256)
    core = llm.core
    for i, prompt in enumerate(PROMPTS * 2):
        core.add_request(f"r{i}", core.text.encode_prompt(prompt), SamplingParams(temperature=1.0, max_tokens=40, seed=i))
    finished: dict[str, str] = {}
    steps = 0
    while core.has_work:
        steps += 1
        if steps == 3:
            for i in range(0, 12, 3):
                core.abort(f"r{i}")
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
    assert len(finished) == 12
    assert {finished[f"r{i}"] for i in range(0, 12, 3)} == {"cancelled"}
    assert_free(llm)


def test_a_crashing_step_fails_only_its_requests(tiny_model_dir, close_draft_dir, reference):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    core = llm.core
    real = core.rt.worker.step

    def flaky(plan):
        if any(e.request.request_id == "bad" for e in plan.entries):
            raise RuntimeError("injected fault")
        return real(plan)

    core.rt.worker.step = flaky
    core.add_request("bad", core.text.encode_prompt(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=5))
    outs = core.step()
    assert outs and outs[0].error and "injected fault" in outs[0].error and outs[0].finish_reason == "error"
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    assert_free(llm)


def test_out_of_range_params_are_clear_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_prompt_longer_than_context_is_refused(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[5] * 4000], SamplingParams(max_tokens=200))
    assert_free(llm)


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from streamsd.model.loader import ModelLoadError
    from tests.tiny import build_model, build_tokenizer

    other = build_model(tmp_path / "other", tokenizer=build_tokenizer(vocab_size=300), seed=2)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(str(tiny_model_dir), draft_model=str(other))


def test_the_cpu_path_never_imports_triton(tiny_model_dir, close_draft_dir, tmp_path):
    """A CPU engine (with a draft model, so both models load) answers without importing Triton: its
    native module reports hundreds of leaked objects at every exit."""
    code = (
        "import sys\n"
        "from streamsd import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, draft_model={str(close_draft_dir)!r}, device='cpu')\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=6, temperature=0.0))\n"
        "assert out[0].outputs[0].token_ids, out\n"
        "print('triton' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["STREAMSD_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"], done.stdout
    assert "nanobind" not in done.stderr
