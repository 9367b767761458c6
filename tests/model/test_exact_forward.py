"""The exact mode's forward: one token's logits are the same bits however its step is made up (alone, in
a verify window, as a prompt row, among 5, 25 or 64 rows at any place), on the CPU and on CUDA, and
greedy output with speculation equals plain decoding at any batch (draft trees: test_exact_trees.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamsd import LLM, SamplingParams
from streamsd.model.arch import ModelArgs
from streamsd.model.exact_forward import ROWS, blocked_linear, enable_exact_reference
from streamsd.model.llama import Transformer
from tests.model.exact_cases import checked_row_logits, differing

CUDA = torch.cuda.is_available()
KV = 8192  # tokens: enough for these prompts; on a GPU the engines of a test would otherwise each take its memory


def _load(path, device: torch.device, dtype: torch.dtype) -> Transformer:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Transformer.build(ModelArgs.from_config(hf.config.to_dict()), hf.state_dict(), device, dtype)


def test_blocked_linear_gives_a_row_the_same_bits_at_any_batch_and_place():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    x = torch.randn(64, 96, generator=g)
    alone = blocked_linear(x[:1], w, b)[0]
    for m in (1, 5, ROWS, 25, 64):
        for where in (0, m // 2, m - 1):
            rows = torch.randn(m, 96, generator=g)
            rows[where] = x[0]
            assert torch.equal(blocked_linear(rows, w, b)[where], alone), (m, where)
    assert torch.allclose(blocked_linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_cpu_forward_gives_a_token_the_same_logits_however_its_step_is_made_up(tiny_model_dir, dtype):
    model = _load(tiny_model_dir, torch.device("cpu"), dtype)
    reference = checked_row_logits(model, torch.device("cpu"), dtype)
    enable_exact_reference(model)
    exact = checked_row_logits(model, torch.device("cpu"), dtype)
    assert differing(exact) == []
    # Still the model: within rounding of the reference forward's logits.
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for name, t in exact.items():
        assert torch.allclose(t, reference[name], rtol=tol, atol=tol), name


PROMPTS = ["The capital of France is", "Once upon a time there was a tiny model", "1 2 3 4 5 6 7", "def add(a, b):",
           "é", "Speculative decoding proposes tokens"]


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


def test_exact_greedy_speculation_and_any_batch_equal_plain_decoding(tiny_model_dir, close_draft_dir):
    device = "cuda" if CUDA else "cpu"
    plain = _greedy(LLM(str(tiny_model_dir), exact=True, device=device, kv_cache_tokens=KV), PROMPTS)
    alone = LLM(str(tiny_model_dir), exact=True, device=device, kv_cache_tokens=KV, max_num_seqs=1)
    assert _greedy(alone, PROMPTS) == plain
    for kw in ({"draft_model": str(close_draft_dir), "num_speculative_tokens": 4}, {"speculative_method": "ngram"}):
        llm = LLM(str(tiny_model_dir), exact=True, device=device, kv_cache_tokens=KV, **kw)
        res = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        assert [r.outputs[0].token_ids for r in res] == plain, kw
        assert sum(r.spec_stats.accepted for r in res) > 0, kw  # the verify windows did run


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_cuda_forward_gives_a_token_the_same_logits_however_its_step_is_made_up(tiny_model_dir, dtype):
    from streamsd.kernels.exact.attention import exact_cuda_attention
    from streamsd.model.fast_forward import enable_fast_forward

    model = _load(tiny_model_dir, torch.device("cuda"), dtype)
    model.attend = exact_cuda_attention
    enable_fast_forward(model, exact=True)
    assert differing(checked_row_logits(model, torch.device("cuda"), dtype)) == []


def test_exact_eagle_chains_equal_plain_decoding_greedy_and_seeded(tiny_model_dir, tmp_path):
    """An EAGLE head reads the target's residual streams, which the exact forward captures too."""
    import json

    from streamsd.model.loader import load_model
    from streamsd.spec_decode.eagle.checkpoint import new_head, save_head

    device = torch.device("cuda" if CUDA else "cpu")
    target = load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)[0]
    torch.manual_seed(0)
    head = new_head(target, kind="eagle3", draft_ids=list(range(384)), norm_before_residual=False)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    save_head(head, tmp_path, config, torch.float32)
    plain = _greedy(LLM(str(tiny_model_dir), exact=True, device=str(device), kv_cache_tokens=KV), PROMPTS)
    llm = LLM(str(tiny_model_dir), exact=True, device=str(device), speculative_method="eagle",
              draft_model=str(tmp_path), num_speculative_tokens=3, kv_cache_tokens=KV)
    res = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == plain
    assert sum(r.spec_stats.drafted for r in res) > 0
    # Seeded sampling too (the head's chains drafted from its argmax).
    plain_sampled, _ = _sampled(LLM(str(tiny_model_dir), exact=True, device=str(device), kv_cache_tokens=KV), PROMPTS)
    assert _sampled(llm, PROMPTS)[0] == plain_sampled


SAMPLED = [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.2, min_p=0.05),
           dict(temperature=0.9, top_p=0.8), dict(temperature=1.0, draft_greedy_threshold=2.0),  # sampled drafts
           dict(temperature=0.0)]


def _sampled(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], int]:
    params = [SamplingParams(max_tokens=32, ignore_eos=True, seed=100 + i, **SAMPLED[i % len(SAMPLED)])
              for i in range(len(prompts))]
    res = llm.generate(prompts, params)
    return [r.outputs[0].token_ids for r in res], sum(r.spec_stats.accepted for r in res)


def test_exact_seeded_sampling_with_speculation_and_at_any_batch_is_plain_sampling(tiny_model_dir, close_draft_dir):
    """In the exact mode every verified position's token is the one plain decoding samples there and
    drafts pass while they equal it: seeded answers are plain decoding's token for token, with a draft
    model (argmax drafts, and sampled ones where a request asks for them), n-gram drafts, alone or
    batched. Without the mode, rejection sampling draws other (equally distributed) tokens."""
    device = "cuda" if CUDA else "cpu"
    prompts = PROMPTS * 2
    plain, _ = _sampled(LLM(str(tiny_model_dir), exact=True, device=device, kv_cache_tokens=KV), prompts)
    assert _sampled(LLM(str(tiny_model_dir), exact=True, device=device, kv_cache_tokens=KV, max_num_seqs=1), prompts)[0] == plain
    draft = {"draft_model": str(close_draft_dir), "num_speculative_tokens": 4}
    for kw in (draft, {"speculative_method": "ngram"}):
        got, accepted = _sampled(LLM(str(tiny_model_dir), exact=True, device=device, kv_cache_tokens=KV, **kw), prompts)
        assert got == plain and accepted > 0, kw
    rejection, accepted = _sampled(LLM(str(tiny_model_dir), device=device, kv_cache_tokens=KV, **draft), prompts)
    assert rejection != _sampled(LLM(str(tiny_model_dir), device=device, kv_cache_tokens=KV), prompts)[0] and accepted > 0
