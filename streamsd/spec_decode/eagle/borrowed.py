"""What an EAGLE head shares with a target whose weights tensor parallelism splits.

A head borrows the target's embedding, lm_head and final norm (spec_decode/eagle/head.py: Shared).
Under tensor parallelism (model/parallel.py) each rank holds only its vocabulary rows of the
embedding and the lm_head, while the head runs on rank 0 alone over the whole vocabulary. So the
head gets whole copies of its own, read once from the target's weight files: only the tensors it
uses (a head that ships its own embedding or lm_head reads none for it), memory-mapped, on rank 0's
device. The final norm is whole on every rank and stays the target's. The copies are the very
weights the unsplit target would lend, so the head drafts what it drafts beside one rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamsd.model.llama import Transformer
from streamsd.model.loader import ModelLoadError, weight_files
from streamsd.spec_decode.eagle.head import Shared

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def whole_vocab(model_dir: Path, target: Transformer, *, embed: bool, lm_head: bool) -> Shared:
    """The target's (`model_dir`'s) embedding and lm_head whole, where `embed` / `lm_head` say the
    head uses them (None where it does not), and the target's own final norm."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    held: dict[str, Path] = {}  # tensor name -> the file holding it
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            held.update(dict.fromkeys(reader.keys(), file))
    # As Transformer.build: a tied model's lm_head, or one whose weights ship none, is its embedding.
    head_name = LM_HEAD if LM_HEAD in held and not target.args.tie_embeddings else EMBED
    wanted = ({EMBED} if embed else set()) | ({head_name} if lm_head else set())
    if wanted - set(held):
        raise ModelLoadError(f"the weights in {model_dir} have no {EMBED} for the EAGLE head")
    weight = target.lm_head.weight  # rank 0's shard: where and in what dtype the copies go
    found: dict[str, torch.Tensor] = {}
    for name in wanted:
        with safe_open(str(held[name]), framework="pt", device="cpu") as reader:
            found[name] = reader.get_tensor(name).to(device=weight.device, dtype=weight.dtype)
    return Shared(
        nn.Embedding.from_pretrained(found[EMBED], freeze=True) if embed else None,
        _linear(found[head_name]) if lm_head else None,
        target.model.norm,
    )


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear over `weight` [V, H], as the target's lm_head is."""
    with torch.device("meta"):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer
