"""One forward for the Llama family (Llama 2/3/3.1, SmolLM, Mistral, Qwen2) over a paged KV cache.

Input is a flat batch of tokens from many requests, each at its own positions — prefill chunks,
single decode tokens and 1 + k verify tokens in one call. Logits come out only at the rows asked
for. Parameter names mirror transformers' so a checkpoint's state dict loads as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from streamsd.model.arch import ModelArgs, rope_tables
from streamsd.model.attention import paged_attention
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.parallel import TensorShard, shard_args

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BatchLayout, float], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers, so bf16 results match it bit for bit where possible.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] -> [T, H, D] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos.unsqueeze(1) + rotated.float() * sin.unsqueeze(1)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.scale = a.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                layout: BatchLayout, attend: AttentionFn) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)  # [T, KVH, D]
        PagedKVCache.write(kv[0], kv[1], k, v, layout.slot_mapping)
        out = attend(q, kv[0], kv[1], layout, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        # An RMSNorm in every target layer; an EAGLE-1 head's layer has an Identity (spec_decode/eagle/head.py).
        self.input_layernorm: RMSNorm | nn.Identity = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        # Given its (uninitialised) table, an embedding skips its random init: on the meta device that
        # init runs through torch's Python decompositions, which import torch._dynamo and with it Triton.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(a.vocab_size, a.hidden_size), freeze=False)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers` as the DecoderLayers they are (a ModuleList's items read as any Module)."""
        return cast(list[DecoderLayer], list(self.layers))


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [N, V] float32 at the requested rows
    hidden: list[torch.Tensor] | None  # residual streams at the requested layers, [N, hidden] each


def store_streams(captured: list[torch.Tensor], streams_into: torch.Tensor | None,
                  slot_mapping: torch.Tensor) -> list[torch.Tensor]:
    """The captured streams (each [T, hidden]) written into `streams_into` [slots, layers * hidden] at
    each row's KV slot, layers side by side; returns what is left to hand back (nothing once stored)."""
    if streams_into is None or not captured:
        return captured
    streams_into.index_copy_(0, slot_mapping, torch.cat(captured, dim=-1).to(streams_into.dtype))
    return []


class Transformer(nn.Module):
    # Buffers (register_buffer below): the RoPE tables, [max_position, head_dim] each.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs, tp: TensorShard | None = None, layer_args: ModelArgs | None = None):
        super().__init__()
        self.args = args
        # Under tensor parallelism (model/parallel.py) this rank's share of the heads, the intermediate
        # width and the vocabulary rows; `args` stays the whole model's.
        self.layer_args = layer_args or args
        self.tp = tp
        self.model = Backbone(self.layer_args)
        self.lm_head = nn.Linear(args.hidden_size, self.layer_args.vocab_size, bias=False)
        self.attend: AttentionFn = paged_attention
        # Another forward every call goes to when set: the CUDA fast path (model/fast_forward.py: fused weights
        # and Triton kernels) on GPUs, or the exact mode's batch-invariant one (model/exact_forward.py).
        self.fast: Callable[..., ForwardOutput] | None = None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    @staticmethod
    def build(args: ModelArgs, state_dict: dict[str, torch.Tensor], device: torch.device,
              dtype: torch.dtype, tp: TensorShard | None = None) -> Transformer:
        """`state_dict`: this rank's shard (model/parallel.py: load_shard) where `tp` is given."""
        with torch.device("meta"):
            model = Transformer(args, tp, shard_args(args, tp.world) if tp is not None else None)
        if args.tie_embeddings or "lm_head.weight" not in state_dict:
            state_dict = {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"]}
        state_dict = {k: v for k, v in state_dict.items() if "rotary_emb" not in k}
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()},
                              strict=True, assign=True)
        model.rope_cos, model.rope_sin = rope_tables(args, device)
        return model.eval()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        layout: BatchLayout,
        cache: PagedKVCache,
        logits_rows: torch.Tensor,  # [N] rows of T whose logits are wanted
        hidden_layers: tuple[int, ...] = (),
        hidden_rows: torch.Tensor | None = None,  # [M] rows whose streams are captured (default: logits_rows)
        every_row: bool = False,  # the CUDA path: all rows in order, with no gathers (fast_forward.py)
        float_logits: bool = True,  # the CUDA path: False keeps the lm_head's dtype
        # a stream store's rows: every row's streams there at its KV slot (hidden_rows: all rows), none returned
        streams_into: torch.Tensor | None = None,
    ) -> ForwardOutput:
        if self.tp is not None:  # rank 0 hands the inputs to the other ranks first
            # The rows whose logits the lm_head computes: every row in order on the fast path's every_row
            # (the reference forward computes logits_rows whatever every_row says).
            rows = torch.arange(input_ids.shape[0], device=input_ids.device) \
                if every_row and self.fast is not None else logits_rows
            self.tp.begin(input_ids, layout, rows)
        if self.fast is not None:  # the CUDA path or the exact one, streams included
            return self.fast(input_ids, layout, cache, logits_rows, hidden_layers, hidden_rows, every_row,
                             float_logits, streams_into)
        cos = self.rope_cos.index_select(0, layout.positions)  # [T, D]
        sin = self.rope_sin.index_select(0, layout.positions)  # [T, D]
        h = self.embed(input_ids)  # [T, hidden]
        captured: list[torch.Tensor] = []
        hidden_rows = logits_rows if hidden_rows is None else hidden_rows
        for i, layer in enumerate(self.model.decoder_layers()):
            if i in hidden_layers:
                captured.append(h.index_select(0, hidden_rows))
            attn = layer.self_attn(layer.input_layernorm(h), cos, sin, cache.layer(i), layout, self.attend)
            h = h + self.reduce(attn)
            h = h + self.reduce(layer.mlp(layer.post_attention_layernorm(h)))
        if self.args.num_layers in hidden_layers:
            captured.append(h.index_select(0, hidden_rows))
        captured = store_streams(captured, streams_into, layout.slot_mapping)
        h = self.model.norm(h.index_select(0, logits_rows))  # [N, hidden]
        logits = self.logits(self.lm_head(h).float())  # [N, V]
        return ForwardOutput(logits=logits, hidden=captured or None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden], from every rank's vocabulary rows under tensor parallelism."""
        table = self.model.embed_tokens
        return table(input_ids) if self.tp is None else self.tp.embed(table.weight, input_ids)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the ranks (itself on one rank)."""
        return x if self.tp is None else self.tp.reduce(x)

    def logits(self, local: torch.Tensor) -> torch.Tensor:
        """The lm_head's output over the whole vocabulary (every rank's columns)."""
        return local if self.tp is None else self.tp.gather_logits(local)
