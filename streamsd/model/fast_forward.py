"""The CUDA forward: the same model as llama.py's, with one GEMM for q/k/v, one for gate/up, and
Triton kernels for add+RMSNorm, RoPE+KV-cache write and SiLU*mul (streamsd/kernels/fused.py).

`fuse_weights` concatenates each layer's q/k/v and gate/up weights once and re-points the
original parameters at views of the concatenation, so memory is unchanged and the eager
reference forward still works on the same tensors. `Transformer.fast` then routes every forward
here, those that capture residual streams for an EAGLE head included: the kernels write the new
residual out of place, so the stream entering layer i is the tensor `h` at the top of its
iteration, captured exactly where the reference forward captures it.

With `exact` (EngineConfig.exact) every linear, the lm_head's included, runs through the batch-invariant
GEMM (kernels/exact/matmul.py) and the final RMSNorm through the one-program-a-row kernel the layers'
norms use; with the exact attention as the model's `attend` (worker/cuda.py sets both), a row's logits
are then the same bits whatever else the step holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from streamsd.kernels.fused import add_rmsnorm, rope_and_cache, silu_mul
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import ForwardOutput, RMSNorm, Transformer, store_streams


@dataclass(frozen=True, slots=True)
class FusedLayer:
    qkv_weight: torch.Tensor  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) D]
    gate_up_weight: torch.Tensor  # [2 I, hidden]


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # x, weight, bias -> y


def concat_params(mods: list[nn.Linear], attr: str) -> torch.Tensor | None:
    parts = [getattr(m, attr) for m in mods]
    if parts[0] is None:
        return None
    joined = torch.cat([p.data for p in parts], dim=0)
    offset = 0
    for m, p in zip(mods, parts, strict=True):
        n = p.shape[0]
        setattr(m, attr, nn.Parameter(joined[offset : offset + n], requires_grad=False))
        offset += n
    return joined


def fuse_weights(model: Transformer) -> list[FusedLayer]:
    fused = []
    for layer in model.model.decoder_layers():
        a, m = layer.self_attn, layer.mlp
        qkv_w = concat_params([a.q_proj, a.k_proj, a.v_proj], "weight")
        qkv_b = concat_params([a.q_proj, a.k_proj, a.v_proj], "bias")
        gate_up = concat_params([m.gate_proj, m.up_proj], "weight")
        assert qkv_w is not None and gate_up is not None
        fused.append(FusedLayer(qkv_w, qkv_b, gate_up))
    return fused


def input_norms(model: Transformer) -> list[torch.Tensor]:
    """Each layer's input RMSNorm weight [hidden], which the fused add+RMSNorm kernel reads."""
    weights: list[torch.Tensor] = []
    for layer in model.model.decoder_layers():
        norm = layer.input_layernorm
        assert isinstance(norm, RMSNorm)  # every target layer's (an EAGLE-1 head's layer has none)
        weights.append(norm.weight)
    return weights


def enable_fast_forward(model: Transformer, exact: bool = False) -> None:
    fused, norms = fuse_weights(model), input_norms(model)
    linear: Linear = F.linear
    if exact:
        from streamsd.kernels.exact.matmul import exact_linear

        linear = exact_linear

    def fast(input_ids: torch.Tensor, layout: BatchLayout, cache: PagedKVCache, logits_rows: torch.Tensor,
             hidden_layers: tuple[int, ...] = (), hidden_rows: torch.Tensor | None = None,
             every_row: bool = False, float_logits: bool = True,
             streams_into: torch.Tensor | None = None) -> ForwardOutput:
        return fast_forward(model, fused, norms, input_ids, layout, cache, logits_rows, hidden_layers, hidden_rows,
                            every_row, float_logits, streams_into, linear, exact)

    model.fast = fast


@torch.inference_mode()
def fast_forward(model: Transformer, fused: list[FusedLayer], norms: list[torch.Tensor], input_ids: torch.Tensor,
                 layout: BatchLayout, cache: PagedKVCache, logits_rows: torch.Tensor, hidden_layers: tuple[int, ...] = (),
                 hidden_rows: torch.Tensor | None = None, every_row: bool = False,
                 float_logits: bool = True, streams_into: torch.Tensor | None = None, linear: Linear = F.linear,
                 exact: bool = False) -> ForwardOutput:
    """every_row: logits and streams of all T rows in order, as they are (logits_rows and hidden_rows
    unread), with no gather copying them; float_logits False: the lm_head's dtype (a reader that
    upcasts as it loads draws the same tokens from them); streams_into: a stream store's rows
    [slots, len(hidden_layers) * hidden], where every row's streams go at its KV slot (hidden_layers
    ascending; none returned). Streams of inner layers go there from the add+RMSNorm that makes them,
    with no copy or cat after. norms: input_norms; linear: every GEMM's; exact: the final norm one
    program a row too."""
    a = model.layer_args  # this rank's heads under tensor parallelism (model/parallel.py)
    t = input_ids.shape[0]
    h = model.embed(input_ids)  # [T, hidden] the residual stream
    layers = model.model.decoder_layers()
    captured: list[torch.Tensor] = []  # [M, hidden] per requested layer, ascending like the reference
    hidden_rows = logits_rows if hidden_rows is None else hidden_rows
    direct = streams_into is not None and all(0 < j < len(layers) for j in hidden_layers)

    def keep(j: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:  # where the stream entering layer j goes
        if not direct or streams_into is None or j not in hidden_layers:  # (direct implies a store)
            return None
        return streams_into, layout.slot_mapping, hidden_layers.index(j) * a.hidden_size

    x, _ = add_rmsnorm(h, None, norms[0], a.rms_norm_eps)  # [T, hidden]
    for i, (layer, f) in enumerate(zip(layers, fused, strict=True)):
        if i in hidden_layers and not direct:  # h is the input of layer i (add_rmsnorm never overwrites it)
            captured.append(h if every_row or streams_into is not None else h.index_select(0, hidden_rows))
        k_cache, v_cache = cache.layer(i)
        qkv = linear(x, f.qkv_weight, f.qkv_bias)  # [T, (H + 2 KVH) D]
        q = rope_and_cache(qkv, model.rope_cos, model.rope_sin, layout.positions, layout.slot_mapping,
                           k_cache, v_cache, a.num_heads, a.num_kv_heads, a.head_dim)  # [T, H, D]
        attn = model.attend(q, k_cache, v_cache, layout, layer.self_attn.scale)  # [T, H, D]
        attn = model.reduce(linear(attn.reshape(t, -1), layer.self_attn.o_proj.weight, None))  # [T, hidden]
        x, h = add_rmsnorm(attn, h, layer.post_attention_layernorm.weight, a.rms_norm_eps)
        mlp = model.reduce(linear(silu_mul(linear(x, f.gate_up_weight, None)), layer.mlp.down_proj.weight, None))  # [T, hidden]
        if i + 1 < len(layers):
            x, h = add_rmsnorm(mlp, h, norms[i + 1], a.rms_norm_eps, keep(i + 1))
        else:
            h = h + mlp
    if a.num_layers in hidden_layers:  # the final pre-norm stream
        captured.append(h if every_row or streams_into is not None else h.index_select(0, hidden_rows))
    captured = store_streams(captured, streams_into, layout.slot_mapping)
    h = h if every_row else h.index_select(0, logits_rows)
    if exact:  # torch's row reduction splits a row differently for another number of rows
        h, _ = add_rmsnorm(h, None, model.model.norm.weight, a.rms_norm_eps)  # [N, hidden]
    else:
        h = model.model.norm(h)  # [N, hidden]
    logits = model.logits(linear(h, model.lm_head.weight, None))  # [N, V]
    return ForwardOutput(logits=logits.float() if float_logits else logits, hidden=captured or None)
