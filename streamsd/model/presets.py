"""Random-weight models of real shapes, for measuring speed where no weights can be downloaded.

`llama-3.1-8b` and `llama-3.2-1b` have the real configurations (vocabulary, layers, heads, GQA,
RoPE scaling) and random weights drawn directly on the target device, so an 8B model costs no
host memory and no disk. Speed does not depend on weight values; acceptance does, which is why
speculation on these is measured with the labelled synthetic proposer.

That proposer needs the target's greedy continuation to be the same whatever the step's shape. With
every weight N(0, 0.02) the layers' outputs outweigh the embedding, the final state is a chaotic
function of the context, and bf16 rounding that differs between GEMM shapes (plain step, verify of
width 1 + k, another batch bucket) flips near-tied argmaxes: on an H200 most requests at B = 64
left their recorded continuation. So the attention and MLP output projections are drawn 10^5 times
smaller: the layers move the residual stream by ~0.2 % of the token's embedding (1000x smaller still
moved it by 20 % over 4 layers, and desyncs went on), so the argmax is the embedding's against
`lm_head`, and the shapes' rounding differences are far below its margins. Bytes read and FLOPs per
step are unchanged. A preset resolves to a
small directory (config.json + a synthetic word-level tokenizer over the full vocabulary, no
weights) so the tokenizer and EOS handling of the engine work as for any model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from streamsd.model.arch import ModelArgs
from streamsd.model.llama import Transformer
from streamsd.model.loader import load_config

_LLAMA3: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_act="silu",
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009], attention_bias=False, mlp_bias=False,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)
OUTPUT_SCALE = 1e-5  # the layers' output projections, relative to the other weights (module doc)
PRESETS = MappingProxyType({
    "llama-3.1-8b": MappingProxyType({**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336,
                                      "num_hidden_layers": 32, "num_attention_heads": 32,
                                      "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}),
    "llama-3.2-1b": MappingProxyType({**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192,
                                      "num_hidden_layers": 16, "num_attention_heads": 32,
                                      "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                                      "rope_scaling": {**_LLAMA3["rope_scaling"], "factor": 32.0}}),
})


def is_preset(spec: str) -> bool:
    return spec in PRESETS


def preset_dir(name: str, home: Path | None = None) -> Path:
    """config.json and a synthetic tokenizer for `name`, written once under the streamsd home."""
    from streamsd.model.loader import streamsd_home

    out = streamsd_home(home) / "presets" / name
    if (out / "tokenizer.json").exists() and (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(PRESETS[name])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    synthetic_tokenizer(cfg["vocab_size"]).save_pretrained(str(out))
    return out


def synthetic_tokenizer(vocab: int):
    """A word-level tokenizer whose ids are words "t0".."t{V-1}": decoding is cheap and total."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def build_preset(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> tuple[Transformer, Path]:
    """The preset's Transformer with N(0, 0.02) weights (unit norms; output projections N(0, 2e-7), see
    the module doc) made on `device`."""
    path = preset_dir(name)
    args = ModelArgs.from_config(load_config(path))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items() if "rotary" not in k}
    gen = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        if key.startswith("rope_") or (key == "lm_head.weight" and args.tie_embeddings):
            continue
        if key.endswith("norm.weight"):
            state[key] = torch.ones(shape, device=device, dtype=dtype)
        else:
            t = torch.empty(shape, device=device, dtype=dtype)
            small = key.endswith(("o_proj.weight", "down_proj.weight"))
            state[key] = t.normal_(0.0, 0.02 * (OUTPUT_SCALE if small else 1.0), generator=gen)
    return Transformer.build(args, state, device, dtype), path
