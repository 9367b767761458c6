"""Our paged forward against transformers' own modeling code (the oracle), float32 on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamsd.model.arch import ModelArgs
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer
from tests.tiny import LLAMA3_ROPE, build_model

BS = 16

FAMILIES = {
    "llama3-rope-untied": dict(family="llama", rope_scaling=LLAMA3_ROPE, tied=False),
    "llama-tied": dict(family="llama", tied=True),
    "qwen2-bias": dict(family="qwen2", tied=False),
    "qwen2-tied": dict(family="qwen2", tied=True),
    "mistral-shape-mha": dict(family="llama", heads=4, kv_heads=4),
}


def _load(path):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    args = ModelArgs.from_config(hf.config.to_dict())
    ours = Transformer.build(args, hf.state_dict(), torch.device("cpu"), torch.float32)
    return hf, ours, args


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory, tiny_tokenizer):
    kw = dict(FAMILIES[request.param])
    path = build_model(tmp_path_factory.mktemp(request.param), tokenizer=tiny_tokenizer, seed=3, **kw)
    return _load(path)


class Seqs:
    """Block tables for a few sequences over one cache, handed out like the scheduler would."""

    def __init__(self, args, num_blocks=64):
        self.cache = PagedKVCache(args, num_blocks, BS, torch.float32, torch.device("cpu"))
        self.free = list(range(num_blocks))[::-1]
        self.tables: dict[int, list[int]] = {}

    def ensure(self, sid: int, tokens: int) -> list[int]:
        table = self.tables.setdefault(sid, [])
        while len(table) * BS < tokens:
            table.append(self.free.pop())
        return table

    def release(self, sid: int) -> None:
        self.free.extend(self.tables.pop(sid))

    def run(self, model, chunks):
        """chunks: list of (sid, start, token_ids). Returns logits for every token of every chunk."""
        ids, starts, counts, tables = [], [], [], []
        for sid, start, toks in chunks:
            ids += toks
            starts.append(start)
            counts.append(len(toks))
            tables.append(self.ensure(sid, start + len(toks)))
        layout = BatchLayout.build(starts, counts, tables, BS, torch.device("cpu"))
        rows = torch.arange(len(ids))
        out = model(torch.tensor(ids), layout, self.cache, rows)
        split = torch.split(out.logits, counts)
        return list(split)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_decode_and_mixed_verify_match_transformers(pair):
    hf, ours, args = pair
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, args.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 18, 50)]
    s = Seqs(args)
    # Prefill: sequence 0 whole, sequence 1 whole, sequence 2 in a first chunk of 10.
    out = s.run(ours, [(0, 0, seqs[0][:30]), (1, 0, seqs[1][:4]), (2, 0, seqs[2][:10])])
    torch.testing.assert_close(out[0], hf_logits(hf, seqs[0][:30]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf, seqs[1][:4]), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], hf_logits(hf, seqs[2][:10]), atol=1e-4, rtol=0)
    # Mixed step: seq 0 verifies 7 tokens across a block boundary, seq 1 decodes one token,
    # seq 2 prefills its next chunk, seq 3 prefills from scratch.
    out = s.run(ours, [(0, 30, seqs[0][30:37]), (1, 4, seqs[1][4:5]), (2, 10, seqs[2][10:18]), (3, 0, seqs[3])])
    torch.testing.assert_close(out[0], hf_logits(hf, seqs[0][:37])[30:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(hf, seqs[1][:5])[4:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], hf_logits(hf, seqs[2][:18])[10:], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[3], hf_logits(hf, seqs[3]), atol=1e-4, rtol=0)


def test_rollback_and_block_reuse_match_fresh_computation(pair):
    hf, ours, args = pair
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, args.vocab_size, (40,), generator=g).tolist()
    wrong = torch.randint(3, args.vocab_size, (6,), generator=g).tolist()
    s = Seqs(args, num_blocks=8)
    s.run(ours, [(0, 0, a[:30])])
    # Verify 6 wrong drafts (written into the cache), then roll back: the next step starts at 30
    # again, so the stale entries are overwritten and never read.
    s.run(ours, [(0, 30, wrong)])
    out = s.run(ours, [(0, 30, a[30:34])])
    torch.testing.assert_close(out[0], hf_logits(hf, a[:34])[30:], atol=1e-4, rtol=0)
    # Free it, hand its (dirty) blocks to another request, whose results must be unaffected.
    s.release(0)
    b = torch.randint(3, args.vocab_size, (45,), generator=g).tolist()
    out = s.run(ours, [(1, 0, b[:17])])
    out += s.run(ours, [(1, 17, b[17:45])])
    torch.testing.assert_close(torch.cat(out), hf_logits(hf, b), atol=1e-4, rtol=0)


def test_hidden_states_match_transformers(pair):
    hf, ours, args = pair
    ids = list(range(5, 25))
    s = Seqs(args)
    layout = BatchLayout.build([0], [len(ids)], [s.ensure(0, len(ids))], BS, torch.device("cpu"))
    out = ours(torch.tensor(ids), layout, s.cache, torch.arange(len(ids)), hidden_layers=(0, 1))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[0], ref[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.hidden[1], ref[1][0], atol=1e-4, rtol=0)


def test_unsupported_architecture_is_named(tiny_model_dir):
    from transformers import GPT2Config

    from streamsd.model.arch import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel"):
        ModelArgs.from_config(GPT2Config(architectures=["GPT2LMHeadModel"]).to_dict())


@pytest.mark.parametrize("config", [
    dict(model_type="llama"),
    dict(model_type="llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=None, head_dim=None),
    dict(model_type="llama", hidden_size=256, num_attention_heads=8, head_dim=64, attention_bias=True,
         tie_word_embeddings=True, eos_token_id=[5, 7], rms_norm_eps=1e-5, max_position_embeddings=4096),
    dict(model_type="mistral"),
    dict(model_type="mistral", num_attention_heads=8, hidden_size=512, num_key_value_heads=2, eos_token_id=None),
    dict(model_type="qwen2"),
    dict(model_type="qwen2", num_key_value_heads=None, hidden_size=64, num_attention_heads=4, tie_word_embeddings=True),
])
def test_a_config_json_reads_as_transformers_reads_it(config):
    """ModelArgs.from_config reads config.json itself (no transformers import on the start path): the
    fields a file leaves out take the defaults transformers' config class of the family gives them."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**config)
    eos = hf.eos_token_id
    heads = hf.num_attention_heads
    want = dict(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=hf.num_key_value_heads or heads,
                head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, rms_norm_eps=hf.rms_norm_eps,
                max_position=hf.max_position_embeddings, tie_embeddings=bool(hf.tie_word_embeddings),
                qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))
    args = ModelArgs.from_config(config)
    assert {k: getattr(args, k) for k in want} == want
