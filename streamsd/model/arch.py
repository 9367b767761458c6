"""The shape of a Llama-family model, read from its config.json.

Read as JSON, with the defaults transformers' config class of the family gives a field the file leaves
out: importing a transformers config class imports much of transformers and of torch.distributed
(seconds of a server's start), which only a RoPE scaling needs (`rope_tables`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    pass


# What transformers' config class of each family gives the fields a config.json may leave out
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, rms_norm_eps=1e-6, max_position_embeddings=2048,
                  tie_word_embeddings=False, attention_bias=False, eos_token_id=2),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-6,
                    max_position_embeddings=4096 * 32, tie_word_embeddings=False, eos_token_id=2),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  tie_word_embeddings=False, eos_token_id=None),
}


@dataclass(frozen=True, slots=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    config: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # config.json, for RoPE

    @staticmethod
    def from_config(config: dict[str, Any]) -> ModelArgs:
        """The shape a config.json's fields give (transformers' defaults for those it leaves out)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED:
            archs = config.get("architectures") or [model_type]
            raise UnsupportedArchitecture(
                f"unsupported architecture {', '.join(map(str, archs))}; streamsd runs "
                f"{', '.join(sorted(SUPPORTED.values()))}"
            )
        cfg = {**FAMILY_DEFAULTS[model_type], **config}
        heads = cfg["num_attention_heads"]
        eos = cfg["eos_token_id"]
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelArgs(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg["num_key_value_heads"] or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg["rms_norm_eps"],
            max_position=cfg["max_position_embeddings"],
            tie_embeddings=bool(cfg["tie_word_embeddings"]),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            config=dict(config),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + head + h


def rope_tables(args: ModelArgs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position, head_dim] in float32, the way transformers computes them."""
    cfg = args.config or {}
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta") or 10000.0)
    if rope_type == "default":
        exponent = torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim
        inv_freq, scale = 1.0 / (theta**exponent), 1.0
    else:
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedArchitecture(f"unsupported RoPE scaling {rope_type!r}")
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.for_model(**cfg), torch.device("cpu"))
    positions = torch.arange(args.max_position, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)
