"""The EAGLE head's layer on the target's fused kernels (CUDA): what fast_forward.py is to llama.py.

Eagerly the head's layer is ~55 small launches (two RMSNorms, RoPE and the SwiGLU each several
element-wise ops); inside a CUDA graph each still costs a few microseconds, and a propose call runs
the layer once per draft: on SmolLM2-135M the head's graph took 0.55 ms of a 2.7 ms step. Here a
layer is ~14 launches: one GEMM for q/k/v and one for gate/up over concatenated weights, Triton
add+RMSNorm, RoPE+KV write and SiLU*mul, the same arithmetic as `EagleHead.run_layer` step for step.
Inference only: training keeps the autograd layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamsd.kernels.fused import add_rmsnorm, rope_and_cache, silu_mul
from streamsd.kernels.tree.head_input import head_input
from streamsd.kernels.tree.head_topk import DraftLogits
from streamsd.model.fast_forward import FusedLayer, concat_params
from streamsd.model.kv_cache import BatchLayout
from streamsd.model.llama import AttentionFn
from streamsd.spec_decode.eagle.head import EAGLE3, EagleHead


@dataclass(frozen=True, slots=True)
class FastHead:
    head: EagleHead
    fused: FusedLayer
    attend: AttentionFn  # the target's paged attention (the Triton kernel)

    def run_layer(self, ids: torch.Tensor, feats: torch.Tensor, layout: BatchLayout,
                  kv: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T], feats [R, H] (rows [T]: token t's is feats[rows[t]]; None: R = T) -> the layer's
        pre-norm output [T, H]; K/V written at layout's slots."""
        head, f = self.head, self.fused
        lay, a, eps = head.layer, head.spec.args, head.spec.args.rms_norm_eps
        if head.spec.kind == EAGLE3:  # the gather, the embedding and both norms: one launch
            mid = head.midlayer
            x, residual = head_input(ids, head.embed_table(), feats, rows, mid.input_layernorm.weight,
                                     mid.hidden_norm.weight, eps, head.spec.norm_before_residual)  # [T, 2H], [T, H]
        else:
            if rows is not None:
                feats = feats.index_select(0, rows)  # [T, H]
            x = head.fc(torch.cat([head.embed(ids).to(feats.dtype), feats], dim=-1))  # [T, H]
            residual = x
        t = x.shape[0]
        qkv = F.linear(x, f.qkv_weight, f.qkv_bias)  # [T, (H + 2 KVH) D]
        q = rope_and_cache(qkv, head.rope_cos, head.rope_sin, layout.positions, layout.slot_mapping, kv[0], kv[1],
                           a.num_heads, a.num_kv_heads, a.head_dim)  # [T, H, D]
        attn = lay.self_attn.o_proj(self.attend(q, kv[0], kv[1], layout, a.head_dim**-0.5).reshape(t, -1))  # [T, H]
        x, h = add_rmsnorm(attn, residual, lay.post_attention_layernorm.weight, eps)  # [T, H] each
        # The residual add in the GEMM's epilogue (one launch, not two). The head only drafts, so its
        # one rounding instead of two moves no output of the target.
        return torch.addmm(h, silu_mul(F.linear(x, f.gate_up_weight)), lay.mlp.down_proj.weight.t())  # [T, H]

    def normed(self, out: torch.Tensor) -> torch.Tensor:
        """The head's final RMSNorm of its output [N, H] (before its lm_head), one launch."""
        return add_rmsnorm(out, None, self.head.norm.weight, self.head.spec.args.rms_norm_eps)[0]


def fast_head(head: EagleHead, attend: AttentionFn, int8_logits: bool = False) -> FastHead:
    """Concatenates the head layer's q/k/v and gate/up weights (the parameters become views, as
    fuse_weights does for the target) and routes the head's final norm through the fused kernel;
    int8_logits: a tree's children come from its norm, an int8 lm_head and their top-k in one pass."""
    att, mlp = head.layer.self_attn, head.layer.mlp
    qkv_w = concat_params([att.q_proj, att.k_proj, att.v_proj], "weight")
    qkv_b = concat_params([att.q_proj, att.k_proj, att.v_proj], "bias")
    gate_up = concat_params([mlp.gate_proj, mlp.up_proj], "weight")
    assert qkv_w is not None and gate_up is not None
    fast = FastHead(head, FusedLayer(qkv_w, qkv_b, gate_up), attend)
    if head.spec.kind == EAGLE3:
        head.fast_norm = fast.normed
    if int8_logits:
        lm = head.output_head()
        head.int8_logits = DraftLogits.build(lm.weight.detach(), head.norm.weight if head.spec.kind == EAGLE3 else None,
                                             head.spec.args.rms_norm_eps, head.d2t if head.has_draft_vocab else None)
    return fast
