"""What the end-to-end engine tests share: the prompts and their HF transformers greedy answers, a check that
an engine freed everything, and a chi-square test of answers against the target's warped distribution."""

from __future__ import annotations

import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamsd import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a tiny model",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "def add(a, b):",
    "Speculative decoding proposes tokens with a cheap draft and verifies them with the target. Speculative",
    "é",
]
MAX_TOKENS = [24, 9, 30, 17, 12, 5]


def hf_greedy(model_dir, prompts, max_tokens):
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p, n in zip(prompts, max_tokens, strict=True):
        ids = tok.encode(p)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def greedy_params():
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def assert_free(llm: LLM) -> None:
    s = llm.core.scheduler
    assert s.blocks.num_free == s.blocks.total, "KV blocks leaked"
    assert len(s.q_slots_free) == s.q_slots_total, "q slots leaked"
    assert not s.running and not s.waiting and not llm.core.trackers


def target_next_token_probs(model_dir, ids, temperature, top_k, top_p, min_p, penalised=None):
    """The target's warped p after `ids`; `penalised`: (prompt length, params) whose bias and penalties
    apply first (the tokens past the prompt count as output)."""
    from streamsd.sample.warp import WarpParams, warp
    from tests.sample.test_penalties import penalised_reference

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1:].float()
    if penalised is not None:
        n, params = penalised
        logits = penalised_reference(logits[0], ids[:n], ids[n:], params).view(1, -1)
    return warp(logits, WarpParams.build([(temperature, top_k, top_p, min_p)], torch.device("cpu")))[0]


def assert_pairs_follow_target(model_dir, prompt: list[int], res: list, warp: tuple,
                               params: SamplingParams | None = None) -> None:
    """The first two tokens of the answers `res` (one per seed) against the target's exact warped
    joint p(t1) p(t2 | t1): no forbidden pair, and a chi-square test (sparse cells pooled). With
    `params`, p is penalised by its logit bias and penalties first."""
    n = len(res)
    pairs = [tuple(r.outputs[0].token_ids[:2]) for r in res]
    penalised = None if params is None else (len(prompt), params)
    p1 = target_next_token_probs(model_dir, prompt, *warp, penalised=penalised)
    firsts = sorted({a for a, _ in pairs} | set((p1 > 0.01).nonzero().flatten().tolist()))
    observed, expected = [], []
    for a in firsts:
        p2 = target_next_token_probs(model_dir, prompt + [a], *warp, penalised=penalised)
        for b in range(p2.numel()):
            e = n * p1[a].item() * p2[b].item()
            o = sum(1 for x in pairs if x == (a, b))
            assert e > 0 or o == 0, "emitted a pair the target forbids"
            observed.append(o)
            expected.append(e)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    big = exp >= 5
    o2 = torch.cat([obs[big], obs[~big].sum().view(1)])
    e2 = torch.cat([exp[big], exp[~big].sum().view(1)])
    e2 = e2 * o2.sum() / e2.sum()
    assert chisquare(o2.numpy(), e2.numpy()).pvalue > 1e-3
