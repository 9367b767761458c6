"""Frozen configuration passed explicitly from the CLI / LLM down to each layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpecMethod = Literal["draft", "ngram", "eagle", "synthetic"]
BLOCK_SIZE = 16
MAX_TREE_NODES = 62  # a tree's window (its root and nodes) fits one int64 bitmask per row
StreamInterval = int | Literal["auto"]  # tokens a streamed answer's deltas gather (engine/async_engine.py)
STREAMS_PER_STEP = 16  # "auto": about this many streams handed a delta per step
# The engine's worker thread and the event loop share one interpreter lock. At Python's default switch
# interval (5 ms) a loop busy with arriving requests and streamed chunks keeps the worker, and with it
# the GPU, waiting up to 5 ms whenever the worker needs the interpreter between its launches and reads;
# 0.5 ms bounds that wait (measured in docs/benchmarks.md, prefix caching). A server sets it while it
# runs, and so does an engine process (engine/core_process.py): its loop and worker share a lock too.
SWITCH_INTERVAL_S = 0.0005


def helper_threads(cores: int | None) -> int:
    """Threads for host work beside the engine (tokenising prompts, filling grammar masks): half the
    cores, 1 to 8. The other half runs the event loop, the engine's worker thread and the device's host side."""
    return max(1, min(8, (cores or 2) // 2))


@dataclass(frozen=True, slots=True)
class TreeShape:
    """How an EAGLE head grows a draft tree each step (spec_decode/eagle/tree.py): the `branch` likeliest
    children of the root, then for each further level the `frontier` likeliest nodes of the last one
    each get their `branch` likeliest children, `depth` levels in all; the `nodes` likeliest of them
    (by path probability) are verified. A chain of k is TreeShape(k, 1, 1, k)."""

    depth: int = 6
    frontier: int = 6
    branch: int = 6
    nodes: int = 31

    def __post_init__(self) -> None:
        d, m, c, n = self.depth, self.frontier, self.branch, self.nodes
        if not (1 <= d <= 16 and 1 <= m <= c and 1 <= n <= MAX_TREE_NODES):
            raise ValueError(f"a draft tree needs 1 <= depth <= 16, 1 <= frontier <= branch and 1 <= nodes <= "
                             f"{MAX_TREE_NODES}; got {self}")
        if n > c + (d - 1) * m * c or d > n:
            raise ValueError(f"a tree of depth {d}, frontier {m} and branch {c} cannot have {n} nodes")
        if m * (d - 1) > n:  # the head's tree slots stay within the verify window the scheduler reserves
            raise ValueError(f"frontier x (depth - 1) = {m * (d - 1)} must not exceed nodes ({n})")

    @staticmethod
    def parse(text: str) -> TreeShape:
        """'depth,frontier,branch,nodes', e.g. '6,6,6,31'."""
        try:
            d, m, c, n = (int(x) for x in text.split(","))
        except ValueError as exc:
            raise ValueError(f"a draft tree is 'depth,frontier,branch,nodes' (e.g. 6,6,6,31), not {text!r}") from exc
        return TreeShape(d, m, c, n)

    def __str__(self) -> str:
        return f"{self.depth},{self.frontier},{self.branch},{self.nodes}"


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
    # An EAGLE head drafts a tree of this shape per step instead of a chain (`num_tokens` is then its
    # node count: the drafts a step verifies).
    tree: TreeShape | None = None
    # On CUDA a tree's drafts are ranked over an int8 copy of the head's lm_head (kernels/tree/head_topk.py):
    # half the bytes a level; the target still verifies, so the output is the same either way.
    int8_draft_head: bool = True
    # The fixed policy speculates only while at most this many requests decode; larger batches take
    # plain steps (0: always speculate). The adaptive one (with trees: policy/chooser.py) decides by itself.
    max_batch: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 0:
            raise ValueError("speculative_max_batch must be >= 0 (0: no limit)")
        if self.max_batch and self.policy != "fixed":
            raise ValueError("the adaptive policy chooses plain steps itself: speculative_max_batch is for the "
                             "fixed policy")
        if self.tree is not None and self.method != "eagle":
            raise ValueError("draft trees are grown by an EAGLE head: use speculative_method='eagle'")
        if self.method is not None and not 1 <= self.num_tokens <= 16 and self.tree is None:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.tree is not None and self.num_tokens != self.tree.nodes:
            raise ValueError(f"a draft tree of {self.tree.nodes} nodes verifies {self.tree.nodes} drafts a step, "
                             f"not num_speculative_tokens={self.num_tokens}")
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
    # KV the worker writes past what a plan covers, in tokens, for a request that drafts (the worker
    # reports both: worker/lookahead.py `kv_margin`); 0 where it writes nothing more. `drafting_reserve`
    # is held past a step that proposes drafts, beyond what the step writes; `drafting_keep` past a
    # request's known tokens is kept when its blocks are trimmed after a step.
    drafting_reserve: int = 0
    drafting_keep: int = 0
    # Positions past the pending token that drafting writes whatever k is (an EAGLE head's draft-tree
    # window, spec_decode/eagle/tree.py); 0 when drafting writes only the k drafts' own.
    draft_window: int = 0
    # Drafts form trees, verified whole up to a request's last tokens (what they accept past
    # max_tokens is cut when appended): a step near the end stays the same step as every other.
    whole_drafts: bool = False
    # Chained steps queued ahead (worker/lookahead.py) verify one k for the whole batch: a request that only
    # max_tokens would cut below it keeps that k, verifying and proposing past its end (free in a graph
    # padded to the widest request; what it accepts past max_tokens is cut when appended). Otherwise
    # from the first request within 2(k + 1) tokens of its end no step is queued until it leaves: on
    # an H200 at B = 64, k = 2, 64-token answers, a fifth of the steps waited for the host.
    drafts_past_max_tokens: bool = False
    # Prefix caching (sched/prefix_cache.py): full blocks of final KV kept and shared by later requests
    # with the same leading tokens. `prefix_draft_kv`: the drafter keeps KV in the same blocks (a draft
    # model, an EAGLE head), which a request taking a block catches up on where it is not there yet;
    # `prefix_streams`: so does an EAGLE head's store of the target's streams;
    # `prefix_next_tokens`: tokens past a block its drafter KV depends on (1 for an EAGLE head).
    enable_prefix_caching: bool = True
    prefix_draft_kv: bool = False
    prefix_streams: bool = False
    prefix_next_tokens: int = 0

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
    kv_cache_memory_fraction: float = 0.85  # of the CUDA memory left to the server, when kv_cache_tokens is None
    # vLLM's: the share of the GPU's whole memory the server may use (weights, caches, working memory);
    # None: all of it that is free once the weights are loaded.
    gpu_memory_utilization: float | None = None
    # vLLM's --chat-template: a Jinja template, or the path of a file holding one, used instead of the
    # tokenizer's own (a model without one can then serve chat completions).
    chat_template: str | None = None
    # vLLM's --seed: requests that give no seed draw theirs from a generator seeded with it, so that a
    # restarted server answers the same sequence of requests alike. None: drawn from the OS.
    seed: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # as asked for (--max-model-len): honoured, or refused at start
    # At most this context, and less where the models or the KV cache hold less (benchmarks size their
    # engines by it); max_model_len is the user's, which is refused rather than cut.
    context_cap: int | None = None
    max_queue: int = 1024
    cuda_graphs: bool = True
    pipeline: bool | None = None  # plain decode steps queued one ahead (worker/lookahead.py); None: on CUDA
    cpu_threads: int | None = None  # CPU only; default: all cores but one, left for the event loop
    # The adaptive policy's start-up cost profile on disk (profile_cache.py): reuse, refresh or off;
    # None: $STREAMSD_PROFILE_CACHE, else reuse.
    profile_cache: str | None = None
    # Sampling defaults from the model's generation_config.json for fields a request leaves out
    # (generation_defaults.py): auto, or none to ignore the file.
    generation_config: str = "auto"
    # Requests sharing leading tokens (a chat's earlier turns, a system prompt) reuse their KV blocks.
    enable_prefix_caching: bool = True
    # Batch-invariant target forward (kernels/exact/, model/exact_forward.py): a row's logits are the same
    # bits whatever else its step holds (a draft tree's rows included), so greedy speculative output equals
    # plain decoding token for token.
    exact: bool = False
    # Ranks the target is split over (Megatron-style, worker/tp.py): rank 0 in this process, the others
    # follower processes, one GPU each on CUDA.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_utilization is not None and self.kv_cache_tokens:
            raise ValueError("give gpu_memory_utilization or kv_cache_tokens, not both: each sizes the KV cache")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size > 1 and self.exact:
            raise ValueError("exact mode runs on one device: the all-reduces of tensor parallelism sum the ranks' "
                             "partial results in an order of their own (use tensor_parallel_size=1 with --exact)")
        if self.tensor_parallel_size > 1 and self.spec.method == "synthetic":
            raise ValueError("speculative_method='synthetic' is a benchmark proposer over preset models, which "
                             "tensor parallelism does not load; use EAGLE, a draft model or n-gram speculation")
