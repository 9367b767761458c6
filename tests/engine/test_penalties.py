"""Logit bias and repetition/frequency/presence penalties through the engine: greedy answers equal HF
transformers' generate with the same repetition penalty and bias, speculative answers equal plain ones
token for token, and sampled answers follow the penalised target distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamsd import LLM, SamplingParams
from tests.engine.engine_helpers import MAX_TOKENS, PROMPTS, assert_free, assert_pairs_follow_target

# Ids the tiny tokenizer uses in these answers (the byte-level alphabet and early merges).
BIAS = {70: 4.0, 88: -100.0, 300: 2.5}
PENALTIES = dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.2, logit_bias=BIAS)


def _greedy(**kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw) for n in MAX_TOKENS]


def _answers(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def plain_penalised(tiny_model_dir) -> list[list[int]]:
    return _answers(LLM(str(tiny_model_dir)), _greedy(**PENALTIES))


def test_penalised_greedy_is_hf_generate_with_the_same_repetition_penalty_and_bias(tiny_model_dir, close_draft_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    want, unpenalised = [], []
    for prompt, n in zip(PROMPTS, MAX_TOKENS, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(hf.generate(ids, repetition_penalty=1.3, sequence_bias={(t,): b for t, b in BIAS.items()},
                                **kw)[0, ids.shape[1]:].tolist())
        unpenalised.append(hf.generate(ids, **kw)[0, ids.shape[1]:].tolist())
    assert want != unpenalised  # the penalty and the bias change these answers
    params = _greedy(repetition_penalty=1.3, logit_bias=BIAS)
    for kw in ({}, {"speculative_method": "ngram"}, {"draft_model": str(close_draft_dir), "num_speculative_tokens": 4}):
        llm = LLM(str(tiny_model_dir), **kw)
        assert _answers(llm, params) == want, kw
        assert_free(llm)


@pytest.mark.parametrize("kw", [
    {"draft_model": "close", "num_speculative_tokens": 1},
    {"draft_model": "close", "num_speculative_tokens": 4},
    {"draft_model": "close", "speculation_policy": "adaptive"},
    {"speculative_method": "ngram"},
], ids=["draft-k1", "draft-k4", "draft-adaptive", "ngram"])
def test_speculative_greedy_with_penalties_equals_plain_greedy(tiny_model_dir, close_draft_dir, plain_penalised, kw):
    kw = {k: str(close_draft_dir) if v == "close" else v for k, v in kw.items()}
    llm = LLM(str(tiny_model_dir), **kw)
    res = llm.generate(PROMPTS, _greedy(**PENALTIES))
    assert [r.outputs[0].token_ids for r in res] == plain_penalised
    if "num_speculative_tokens" in kw:  # drafts were both accepted and rejected against the penalised target
        assert sum(r.spec_stats.accepted for r in res) > 0
        assert sum(r.spec_stats.drafted - r.spec_stats.accepted for r in res) > 0
    assert_free(llm)


def test_penalised_and_plain_requests_share_a_batch_exactly(tiny_model_dir, close_draft_dir, plain_penalised):
    """Requests with and without penalties in one speculative batch: each gets its own answer."""
    unpenalised = _answers(LLM(str(tiny_model_dir)), _greedy())
    assert unpenalised != plain_penalised
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3)
    res = llm.generate(PROMPTS * 2, _greedy(**PENALTIES) + _greedy())
    assert [r.outputs[0].token_ids for r in res] == plain_penalised + unpenalised
    assert_free(llm)


def test_steps_queued_ahead_leave_penalised_requests_out_and_stay_exact(tiny_model_dir, plain_penalised):
    """Pipelined plain steps (the next queued before this one's tokens are read) cannot count a token
    the host has not seen: a batch holding a penalised request takes its full path, and the plain
    requests are queued ahead again once the penalised ones have finished."""
    longer = [SamplingParams(temperature=0.0, max_tokens=n + 16, ignore_eos=True) for n in MAX_TOKENS]
    unpenalised = _answers(LLM(str(tiny_model_dir)), longer)
    llm = LLM(str(tiny_model_dir), pipeline=True)
    res = llm.generate(PROMPTS * 2, _greedy(**PENALTIES) + longer)
    assert [r.outputs[0].token_ids for r in res] == plain_penalised + unpenalised
    assert llm.core.rt.worker.lookahead.taken > 0
    assert_free(llm)


# Penalties that reward repeating (this random model rarely repeats a token by itself): the second
# token's p then depends strongly on whether the first is counted, which a verify row must do.
@pytest.mark.parametrize("text,temperature,top_k,penalties", [
    ("a a a a a a", 0.8, 8, dict(repetition_penalty=0.4, presence_penalty=-2.0, logit_bias={70: 2.0})),
    ("def add(a, b):", 0.6, 8, dict(repetition_penalty=0.5, frequency_penalty=-1.0, logit_bias={88: -100.0})),
], ids=["dense-q", "one-hot-q"])
def test_end_to_end_penalised_sampling_matches_the_penalised_target(tiny_model_dir, close_draft_dir, text,
                                                                    temperature, top_k, penalties):
    """3000 seeds: the joint of the first two tokens is the target's penalised, warped p; the second is
    decided by a verify row that counts the first (an accepted draft) as output. Drafts at T >= 0.75
    are sampled (dense q), below it greedy (one-hot q)."""
    n = 3000
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3,
              max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.text.encode_prompt(text)
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, seed=s, ignore_eos=True,
                             **penalties) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, top_k, 1.0, 0.0), params[0])
    _assert_third_tokens_follow_target(tiny_model_dir, prompt, res, (temperature, top_k), params[0])


def _assert_third_tokens_follow_target(model_dir, prompt: list[int], res: list, warp_args: tuple,
                                       params: SamplingParams) -> None:
    """The third token given the first two, against the penalised p after them (cells pooled over the
    observed prefixes): the first verify after the prompt decides the second token at its pending row
    and the third at the row after the first draft, which must count that draft as output."""
    from streamsd.sample.warp import WarpParams, warp
    from tests.sample.test_penalties import penalised_reference

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    wp = WarpParams.build([(*warp_args, 1.0, 0.0)], torch.device("cpu"))
    by_prefix: dict[tuple[int, int], list[int]] = {}
    for r in res:
        a, b, c = r.outputs[0].token_ids[:3]
        by_prefix.setdefault((a, b), []).append(c)
    observed, expected = [], []
    for (a, b), thirds in by_prefix.items():
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + [a, b]])).logits[0, -1].float()
        p3 = warp(penalised_reference(logits, prompt, [a, b], params).view(1, -1), wp)[0]
        observed.append(torch.bincount(torch.tensor(thirds), minlength=p3.numel()))
        expected.append(p3 * len(thirds))
    obs, exp = torch.cat(observed).double(), torch.cat(expected).double()
    assert (obs[exp == 0] == 0).all(), "emitted a token the target forbids"
    big = exp >= 5
    o2, e2 = torch.cat([obs[big], obs[~big].sum().view(1)]), torch.cat([exp[big], exp[~big].sum().view(1)])
    assert chisquare(o2.numpy(), (e2 * o2.sum() / e2.sum()).numpy()).pvalue > 1e-3
