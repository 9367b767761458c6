"""The speculation side of an engine's build: the drafter an EngineConfig names, loaded beside the
target (a draft model or an EAGLE head; n-gram lookup needs none), the q pool the verifier reads
the drafts' probabilities from, and the proposer over them (spec_decode/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsd.config import BLOCK_SIZE, EngineConfig
from streamsd.model.arch import ModelArgs
from streamsd.model.kv_cache import PagedKVCache
from streamsd.model.llama import Transformer
from streamsd.model.loader import ModelLoadError, load_model, load_tokenizer
from streamsd.model.stream_store import StreamStore
from streamsd.spec_decode.draft_model import DraftModelProposer
from streamsd.spec_decode.eagle.checkpoint import head_dir, load_head, measured_depth_steps
from streamsd.spec_decode.eagle.head import EagleHead
from streamsd.spec_decode.eagle.proposer import EagleProposer
from streamsd.spec_decode.ngram import NgramProposer
from streamsd.spec_decode.proposer import Proposer


@dataclass(frozen=True, slots=True)
class Drafters:
    """What drafts beside the target: a draft model, or an EAGLE head, or neither."""

    draft: Transformer | None = None
    head: EagleHead | None = None
    depth_steps: tuple[tuple[str, tuple[float, ...]], ...] = ()  # the head's measured cost by depth
    dirs: tuple[Path, ...] = ()  # where they were loaded from (part of the cost profile's cache key)

    def kv_bytes_per_token(self, target: Transformer, dtype: torch.dtype) -> int:
        """Every cache of a token: the target's (under tensor parallelism this rank's kv heads), the
        drafter's, and an EAGLE head's streams (model/stream_store.py)."""
        extra = self.draft.args if self.draft else self.head.spec.args if self.head else None
        n = target.layer_args.kv_bytes_per_token(dtype) + (extra.kv_bytes_per_token(dtype) if extra else 0)
        if self.head is not None:
            n += StreamStore.bytes_per_token(self.head.input_layers, target.args.hidden_size, dtype)
        return n


def load_drafters(cfg: EngineConfig, target: Transformer, path: Path, device: torch.device, dtype: torch.dtype,
                  target_tokenizer: Callable[[], Any]) -> Drafters:
    """The draft model (its vocabulary checked against the target's tokenizer) or the EAGLE head
    `cfg.spec` names, on `device`."""
    if cfg.spec.method == "draft":
        assert cfg.spec.draft_model
        draft, draft_path = load_model(cfg.spec.draft_model, device, dtype)
        check_vocab(target_tokenizer(), load_tokenizer(draft_path), target.args, draft.args)
        return Drafters(draft=draft, dirs=(draft_path,))
    if cfg.spec.method == "eagle":
        hdir = head_dir(cfg.spec.draft_model, cfg.model)
        return Drafters(head=load_head(hdir, target, device, dtype, path), depth_steps=measured_depth_steps(hdir),
                        dirs=(Path(hdir),))
    return Drafters()


def q_pool_for(cfg: EngineConfig, drafters: Drafters, vocab: int, device: torch.device,
               queues_ahead: bool) -> tuple[int, torch.Tensor | None]:
    """(request slots, the pool [slots x halves + 1, k, V]) of the drafts' dense probabilities, which
    a model's drafts keep for rejection sampling; (0, None) where none are kept.

    One row more than the scheduler hands out: graph-captured drafting writes the q of its greedy and
    padding rows there (spec_decode/eagle/graphs.py). A verify queued ahead (worker/lookahead.py)
    drafts into each request's second half of the pool, so that dropping it leaves the q the next
    verify reads intact: two rows a slot then."""
    tree = cfg.spec.tree
    if tree is not None:  # a tree's drafts are one-hot whatever the temperature (sample/tree_verify.py)
        return 0, torch.zeros(1, 1, vocab, device=device)  # the proposer's q rows nobody reads
    if drafters.draft is None and drafters.head is None:
        return 0, None
    slots, halves = cfg.max_num_seqs, 2 if queues_ahead else 1
    return slots, torch.zeros(halves * slots + 1, cfg.spec.num_tokens, vocab, device=device)


def build_proposer(cfg: EngineConfig, drafters: Drafters, target: Transformer, q_pool: torch.Tensor | None,
                   num_blocks: int, device: torch.device, dtype: torch.dtype) -> Proposer | None:
    """The proposer over `drafters`, its caches as large as the target's (`num_blocks` and the scratch
    block), or n-gram lookup, or None without speculation."""
    draft, head, vocab = drafters.draft, drafters.head, target.args.vocab_size
    if draft is not None and q_pool is not None:
        return DraftModelProposer(draft, PagedKVCache(draft.args, num_blocks + 1, BLOCK_SIZE, dtype, device), q_pool,
                                  vocab)
    if head is not None and q_pool is not None:
        store = StreamStore(head.input_layers, target.args.hidden_size, (num_blocks + 1) * BLOCK_SIZE, dtype, device)
        return EagleProposer(head, target, PagedKVCache(head.spec.args, num_blocks + 1, BLOCK_SIZE, dtype, device),
                             q_pool, store, drafters.depth_steps, tree=cfg.spec.tree,
                             int8_lm_head=cfg.spec.int8_draft_head)
    if cfg.spec.method == "ngram":
        return NgramProposer(cfg.spec.ngram_max, cfg.spec.ngram_min)
    if cfg.spec.method is not None:
        raise ValueError(f"speculative method {cfg.spec.method!r} is not available here")
    return None


def check_vocab(target_tok: Any, draft_tok: Any, target: ModelArgs, draft: ModelArgs) -> None:
    """Drafts are token ids: they mean the same only if both tokenizers map text to ids alike."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    mismatched = [t for t, i in tv.items() if dv.get(t) != i]
    if mismatched:
        raise ModelLoadError(
            f"the draft model's vocabulary does not match the target's ({len(mismatched)} of {len(tv)} tokens "
            f"differ, e.g. {mismatched[:3]}); use a draft from the same model family"
        )
    if draft.vocab_size < len(tv):
        raise ModelLoadError("the draft model's embedding is smaller than the target's vocabulary")
