"""Frozen configuration passed explicitly from the CLI / LLM down to each layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpecMethod = Literal["draft", "ngram", "eagle", "synthetic"]
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class SpecConfig:
    method: SpecMethod | None = None
    num_tokens: int = 4  # K, the most drafts any request verifies per step
    draft_model: str | None = None
    draft_greedy_threshold: float = 0.75
    ngram_max: int = 4
    ngram_min: int = 1
    synthetic_acceptance: float = 0.8  # only for the labelled synthetic proposer
    policy: Literal["adaptive", "fixed"] = "fixed"  # adaptive: k per request and step from measured costs

    def __post_init__(self) -> None:
        if self.method is not None and not 1 <= self.num_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs a draft_model")
        if not 0.0 <= self.draft_greedy_threshold <= 100.0:
            raise ValueError("draft_greedy_threshold must be in [0, 100]")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = BLOCK_SIZE
    max_queue: int = 1024
    # Tokens of KV held past a speculative step's own reservation, for the step the worker queues
    # behind it before reading it (lookahead.py: an EAGLE head's verify and chain); 0 when it does not.
    lookahead: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("num_blocks, max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    spec: SpecConfig = SpecConfig()
    device: str | None = None
    dtype: str = "auto"
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float = 0.85  # of free CUDA memory, when kv_cache_tokens is None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_queue: int = 1024
    cuda_graphs: bool = True
    pipeline: bool | None = None  # plain decode steps queued one ahead (lookahead.py); None: on CUDA
    cpu_threads: int | None = None  # CPU only; default: all cores but one, left for the event loop
