"""The exact mode with EAGLE draft trees: a window row's logits are the bits its token gets in plain
decoding (kernels/exact/attention.py, model/exact_forward.py), so greedy and seeded sampled answers
with trees are plain decoding's token for token."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from tests.model.test_exact_forward import PROMPTS, _greedy, _sampled
from tests.spec_decode.eagle_helpers import train_tiny_head

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KV = 8192  # tokens: plenty for these prompts; on a GPU each engine would otherwise take most of its memory
# Past 64 positions while it generates: windows across a 64-key block of the exact kernel's walk.
LONG = "one two three four five six seven eight nine ten " * 5


@pytest.fixture(scope="module")
def head(tiny_model_dir, tmp_path_factory):
    return train_tiny_head(tiny_model_dir, tmp_path_factory.mktemp("exact_tree_head"), "eagle3_norm_first")


def test_exact_mode_takes_draft_trees(tiny_model_dir, head):
    llm = LLM(str(tiny_model_dir), exact=True, device=DEVICE, speculative_method="eagle", draft_model=str(head),
              speculative_tree="2,2,2,4", kv_cache_tokens=KV)
    assert llm.core.rt.exact and llm.core.spec.tree is not None


@pytest.mark.parametrize("shape", ["4,3,3,10", "3,2,2,5"])
def test_exact_eagle_trees_equal_plain_decoding_greedy_and_seeded(tiny_model_dir, head, shape):
    prompts = [*PROMPTS, LONG]
    plain = LLM(str(tiny_model_dir), exact=True, device=DEVICE, kv_cache_tokens=KV)
    greedy, (sampled, _) = _greedy(plain, prompts), _sampled(plain, prompts * 2)
    tree = LLM(str(tiny_model_dir), exact=True, device=DEVICE, speculative_method="eagle", draft_model=str(head),
               speculative_tree=shape, kv_cache_tokens=KV)
    res = tree.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == greedy
    assert sum(r.spec_stats.accepted for r in res) > 0  # window rows past the root decided tokens
    got, accepted = _sampled(tree, prompts * 2)
    assert got == sampled and accepted > 0
