"""EAGLE draft heads: one decoder layer that drafts from the target's own hidden states.

EAGLE-3: the target's residual streams at a few layers (HF `hidden_states[i]`, the input of
layer i) are fused by `fc`, normalised beside the normalised embedding of the next token and fed
as [embedding, hidden] (2 x hidden wide) to one decoder layer (`midlayer`); its pre-norm output
goes through `norm` and `lm_head` over a draft vocabulary whose ids map to the target's through
`d2t` (target = draft + d2t[draft]); without `lm_head` the target's own head is used. EAGLE-1:
`fc` over [embedding, the target's final normed hidden state], one plain decoder layer
(`layers.0`, no input norm), logits from the target's `lm_head`.

At target position t the head sees the target's h_t and the token at t + 1 and predicts the
token at t + 2; when drafting further it feeds its own pre-norm output back as h. Parameter
names follow the community's checkpoints (SafeAILab EAGLE, vLLM `eagle3`), so heads move
between them; `embed_tokens` is shared with the target unless the checkpoint ships one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from streamsd.model.arch import ModelArgs, rope_tables
from streamsd.model.llama import DecoderLayer, RMSNorm, Transformer, apply_rope
from streamsd.sample.greedy import row_argmax

if TYPE_CHECKING:
    from streamsd.kernels.tree.head_topk import DraftLogits

EAGLE3, EAGLE1 = "eagle3", "eagle1"
# (q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
HeadAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's layers (2, L//2, L-3); targets too shallow for three distinct ones use the last
    three streams (for L = 2: the embedding, layer 1's input and the final pre-norm stream)."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return tuple(range(max(num_layers - 2, 0), num_layers + 1))


@dataclass(frozen=True, slots=True)
class HeadSpec:
    kind: str  # EAGLE3 or EAGLE1
    args: ModelArgs  # the head's decoder layer (attention and MLP shapes, RoPE)
    vocab_size: int  # the target vocabulary it drafts for
    draft_vocab_size: int
    target_hidden_size: int
    # Residual streams the head reads, as HF hidden_states indices: EAGLE-3's fused layers, or
    # (L,) for EAGLE-1, whose final stream gets the target's final norm here.
    aux_layers: tuple[int, ...]
    fc_bias: bool = False
    norm_before_residual: bool = False


@dataclass(frozen=True, slots=True)
class Shared:
    """The target's modules a head borrows (not saved with it): the target's own, or whole copies of
    those a tensor-parallel target splits (spec_decode/eagle/borrowed.py), None where the head has its own."""

    embed: nn.Embedding | None
    lm_head: nn.Linear | None
    norm: RMSNorm


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's decoder layer: q/k/v over [embedding, hidden] (EagleHead widens them) and `hidden_norm`
    (EagleHead adds it) over the fused target states, beside the input norm of the embedding."""

    input_layernorm: RMSNorm
    hidden_norm: RMSNorm


class EagleHead(nn.Module):
    # Buffers (register_buffer below): d2t and t2d for EAGLE-3, the RoPE tables once attached.
    d2t: torch.Tensor
    t2d: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, spec: HeadSpec, *, own_lm_head: bool, own_embed: bool):
        super().__init__()
        a, h = spec.args, spec.args.hidden_size
        self.spec = spec
        #: what it does not borrow from the target (EAGLE-1 drafts through the target's lm_head)
        self.own_embed = own_embed
        self.own_lm_head = own_lm_head and spec.kind == EAGLE3
        if spec.kind == EAGLE3:
            mid = Eagle3Layer(a)
            self.fc = nn.Linear(len(spec.aux_layers) * spec.target_hidden_size, h, bias=spec.fc_bias)
            att = mid.self_attn
            # The layer reads [embedding, hidden]: q, k and v are twice as wide on input.
            att.q_proj = nn.Linear(2 * h, a.num_heads * a.head_dim, bias=a.qkv_bias)
            att.k_proj = nn.Linear(2 * h, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
            att.v_proj = nn.Linear(2 * h, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
            mid.hidden_norm = RMSNorm(h, a.rms_norm_eps)
            self.midlayer = mid
            self.norm = RMSNorm(h, a.rms_norm_eps)
            if own_lm_head:
                self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(spec.vocab_size, dtype=torch.bool))
        else:
            layer = DecoderLayer(a)
            self.fc = nn.Linear(2 * h, h, bias=spec.fc_bias)
            layer.input_layernorm = nn.Identity()  # EAGLE-1's first layer has none
            self.layers = nn.ModuleList([layer])
        if own_embed:
            self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(spec.vocab_size, h), freeze=False)  # as llama.py's
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.shared: Shared | None = None
        # The final norm on the fused kernel (spec_decode/eagle/fast.py sets it on CUDA); None: `norm`.
        self.fast_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
        # A tree's children through kernels/tree/head_topk.py (spec_decode/eagle/fast.py sets it on CUDA); None: draft_logits.
        self.int8_logits: DraftLogits | None = None
        #: the streams the target returns (ascending, as its forward captures them)
        self.input_layers = tuple(sorted(set(spec.aux_layers)))
        self._order = [self.input_layers.index(i) for i in spec.aux_layers]

    def attach(self, target: Transformer, shared: Shared | None = None) -> EagleHead:
        """Borrow the target's embedding, head and final norm (or `shared`, where the target holds a
        tensor-parallel shard of them); RoPE tables to its context length."""
        self.shared = shared if shared is not None else Shared(target.model.embed_tokens, target.lm_head,
                                                               target.model.norm)
        args = dataclasses.replace(self.spec.args, max_position=max(self.spec.args.max_position,
                                                                     target.args.max_position))
        self.rope_cos, self.rope_sin = rope_tables(args, target.rope_cos.device)
        return self

    @property
    def layer(self) -> DecoderLayer:
        return self.midlayer if self.spec.kind == EAGLE3 else cast(DecoderLayer, self.layers[0])

    @property
    def has_draft_vocab(self) -> bool:
        return self.own_lm_head and self.spec.draft_vocab_size != self.spec.vocab_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.embed_table())

    def embed_table(self) -> torch.Tensor:
        """[V, H]: the head's own embedding, or the target's."""
        if self.own_embed:
            return self.embed_tokens.weight
        assert self.shared is not None and self.shared.embed is not None  # attach() lends what it lacks
        return self.shared.embed.weight

    def features(self, streams: torch.Tensor) -> torch.Tensor:
        """The target's streams at `input_layers`, side by side [T, n * Ht] -> h [T, H]."""
        streams = streams.to(self.fc.weight.dtype)
        if self.spec.kind == EAGLE3:
            if self._order != list(range(len(self.input_layers))):  # fc's blocks follow aux_layers' order
                t, n = streams.shape[0], len(self.input_layers)
                streams = streams.view(t, n, -1)[:, self._order].reshape(t, -1)
            return self.fc(streams)
        assert self.shared is not None  # attach() lends the target's final norm
        return self.shared.norm(streams)

    def run_layer(self, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                  attend: HeadAttention) -> torch.Tensor:
        """ids [T], feats [T, H] (fused target states or the head's own output) -> pre-norm out [T, H]."""
        lay, a = self.layer, self.spec.args
        emb = self.embed(ids).to(feats.dtype)  # [T, H]
        if self.spec.kind == EAGLE3:
            normed = self.midlayer.hidden_norm(feats)
            residual = normed if self.spec.norm_before_residual else feats
            x = torch.cat([self.midlayer.input_layernorm(emb), normed], dim=-1)  # [T, 2H]
        else:
            x = self.fc(torch.cat([emb, feats], dim=-1))  # [T, H]
            residual = x
        t = x.shape[0]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, D]
        att = lay.self_attn
        q = apply_rope(att.q_proj(x).view(t, a.num_heads, a.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(att.k_proj(x).view(t, a.num_kv_heads, a.head_dim), cos, sin)  # [T, KVH, D]
        v = att.v_proj(x).view(t, a.num_kv_heads, a.head_dim)  # [T, KVH, D]
        h = residual + att.o_proj(attend(q, k, v).reshape(t, -1))
        return h + lay.mlp(lay.post_attention_layernorm(h))

    def draft_logits(self, out: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Pre-norm output [N, H] -> logits [N, Vd] over the draft vocabulary (float32; upcast False: the
        lm_head's dtype, for a reader that converts as it loads)."""
        x = out if self.spec.kind == EAGLE1 else (self.fast_norm or self.norm)(out)
        head = self.output_head()
        logits = head(x.to(head.weight.dtype))  # a float32 head in training may share a bf16 lm_head
        return logits.float() if upcast else logits

    def output_head(self) -> nn.Linear:
        """The head's own lm_head, or the target's."""
        if self.own_lm_head:
            return self.lm_head
        assert self.shared is not None and self.shared.lm_head is not None  # attach() lends what it lacks
        return self.shared.lm_head

    def greedy_draft(self, out: torch.Tensor) -> torch.Tensor:
        """[N, H] -> the argmax target ids [N]: `target_logits(out).argmax(-1)` without the [N, V] scatter
        (draft ids ascend with target ids, so ties break alike)."""
        best = row_argmax(self.draft_logits(out)[:, : self.spec.vocab_size])  # [N]
        return best + self.d2t[best] if self.has_draft_vocab else best

    def target_logits(self, out: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> [N, V] over the target vocabulary; ids outside the draft vocabulary are impossible."""
        logits = self.draft_logits(out, upcast)  # [N, Vd]
        if not self.has_draft_vocab:
            return logits[:, : self.spec.vocab_size]
        full = logits.new_full((logits.shape[0], self.spec.vocab_size), float("-inf"))  # [N, V]
        return full.index_copy_(1, self.draft_to_target(), logits)

    def draft_to_target(self) -> torch.Tensor:
        d2t = self.d2t  # [Vd]
        return torch.arange(d2t.numel(), device=d2t.device) + d2t


def head_config(spec: HeadSpec, target_config: dict[str, Any]) -> dict[str, Any]:
    """The head's config.json: a one-layer Llama config plus the EAGLE fields loaders look for."""
    a = spec.args
    keep = ("rope_theta", "rope_scaling", "rope_parameters", "bos_token_id", "eos_token_id")
    cfg = {k: target_config[k] for k in keep if k in target_config}
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3" if spec.kind == EAGLE3 else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1, "tie_word_embeddings": False,
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps, "max_position_embeddings": a.max_position,
        "vocab_size": spec.vocab_size, "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size, "bias": spec.fc_bias,
    })
    if "rope_parameters" in cfg and "rope_theta" not in cfg:  # older readers look for rope_theta
        cfg["rope_theta"] = cfg["rope_parameters"].get("rope_theta", 10000.0)
    if spec.kind == EAGLE3:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(spec.aux_layers),
                               "use_aux_hidden_state": True}
        cfg["norm_before_residual"] = spec.norm_before_residual
    return cfg
