"""How a llama.cpp GGUF of a Llama-family model maps onto a Hugging Face directory: the config keys,
the tensor names, and the rotary permutation llama.cpp applies to Llama's q and k projections.

Only the architectures streamsd runs (loader.SUPPORTED_ARCHITECTURES) are mapped; the result is
checked against transformers' own GGUF reader in the tests (same config, same tensors).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from streamsd.model.loader import SUPPORTED_ARCHITECTURES, ModelLoadError

# {arch}.<key> -> HF config field (transformers' GGUF_CONFIG_MAPPING for these architectures)
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
_FIXED_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def model_type(metadata: dict[str, Any]) -> str:
    """The HF model_type: the GGUF architecture, except that llama.cpp writes Mistral as llama."""
    arch = str(metadata.get("general.architecture"))
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        return "mistral"
    return arch


def hf_config_dict(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The config.json fields of a GGUF of a supported architecture; a ModelLoadError otherwise."""
    arch, kind = str(metadata.get("general.architecture")), model_type(metadata)
    architectures = [a for a, t in SUPPORTED_ARCHITECTURES.items() if t == kind]
    if not architectures:
        supported = ", ".join(sorted(set(SUPPORTED_ARCHITECTURES.values())))
        raise ModelLoadError(f"unsupported model architecture {arch!r} in this GGUF; streamsd runs {supported}")
    config: dict[str, Any] = {"model_type": kind, "architectures": architectures,
                              "tie_word_embeddings": "output.weight" not in tensor_names}
    for key, field in _ARCH_KEYS.items():
        if f"{arch}.{key}" in metadata and not (kind == "qwen2" and field == "head_dim"):
            config[field] = metadata[f"{arch}.{key}"]
    for key, field in _TOKEN_KEYS.items():
        if key in metadata:
            config[field] = metadata[key]
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the vocabulary's length
    return config


def hf_tensor_name(name: str) -> str:
    """The HF name of a GGUF tensor; a ModelLoadError for one the layout does not know."""
    if name in _FIXED_TENSORS:
        return _FIXED_TENSORS[name]
    m = _BLOCK_NAME.match(name)
    if m and m.group(2) in _BLOCK_TENSORS:
        layer, part, suffix = m.groups()
        return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{suffix}"
    raise ModelLoadError(f"this GGUF holds a tensor {name!r} that a Llama-family model does not have; "
                         "pass the model's Hugging Face directory instead")


def unpermute_rotary(name: str, weight: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """llama.cpp stores each head's rotary halves of a Llama q/k projection interleaved (its rope
    is the GPT-J pairing); undo that for HF's rotate-half layout. Qwen2 is stored as it is."""
    if config["model_type"] not in ("llama", "mistral") or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return weight
    heads = config["num_attention_heads"] if name.endswith("attn_q.weight") else config["num_key_value_heads"]
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
