"""From an EngineConfig to a ready worker: resolve and load the models, size the caches."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from streamsd.config import BLOCK_SIZE, EngineConfig, SchedulerConfig, TreeShape
from streamsd.engine.generation_defaults import GenerationDefaults
from streamsd.engine.kv_sizing import context_length, kv_blocks
from streamsd.engine.proposers import build_proposer, load_drafters, q_pool_for
from streamsd.engine.warm_up import warm_up, warm_up_chat_prompt
from streamsd.model.arch import ModelArgs
from streamsd.model.exact_forward import enable_exact_reference
from streamsd.model.kv_cache import PagedKVCache
from streamsd.model.llama import Transformer
from streamsd.model.loader import (
    ModelLoadError,
    chat_template_of,
    check_architecture,
    eos_ids_of,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model,
    streamsd_home,
)
from streamsd.model.tokenizer import Tokenizer
from streamsd.policy.adaptive import CostTable
from streamsd.policy.chooser import TreeChooser
from streamsd.policy.policy import AdaptivePolicy, FixedPolicy, SpeculationPolicy
from streamsd.sample.grammar import Grammars
from streamsd.spec_decode.proposer import Proposer
from streamsd.worker.lookahead import KVMargin, kv_margin
from streamsd.worker.tp import TensorGroup, default_threads, use_kernels
from streamsd.worker.worker import Worker

GC_YOUNG_THRESHOLD = 10_000  # see _freeze_heap
log = logging.getLogger("streamsd")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Runtime:
    worker: Worker
    tokenizer: Tokenizer
    args: ModelArgs
    scheduler_config: SchedulerConfig
    model_dir: Path
    eos_ids: frozenset[int]
    q_slots: int
    load_seconds: float
    policy: SpeculationPolicy
    grammars: Grammars
    generation_defaults: GenerationDefaults = GenerationDefaults()
    group: TensorGroup | None = None  # the follower ranks under tensor parallelism (worker/tp.py)
    exact: bool = False  # the exact mode: batch-invariant target logits, drafts verified against plain sampling
    chat_template: str | None = None  # used instead of the tokenizer's own (EngineConfig.chat_template)
    seed: int | None = None  # of the generator unseeded requests draw their seeds from (EngineConfig.seed)

    def close(self) -> None:
        """Stops and joins the follower ranks, if any."""
        if self.group is not None:
            self.group.close()


def pick_device(name: str | None) -> torch.device:
    """The device asked for; else $STREAMSD_DEVICE; else CUDA when there is one."""
    name = name or os.environ.get("STREAMSD_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: $STREAMSD_DTYPE if set, else bfloat16 on CUDA and on CPUs that multiply bf16 natively
    (AVX512-BF16 or AMX: there a verify of 1 + k tokens costs little more than one, and a step less
    than in float32), else float32."""
    if name == "auto":
        name = os.environ.get("STREAMSD_DTYPE") or "auto"
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or native_cpu_bf16() else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {name!r}")
    return table[name]


def native_cpu_bf16() -> bool:
    """The CPU has bf16 matrix instructions (torch's own probe; False where torch has none)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def load_parallel(cfg: EngineConfig, device: torch.device, dtype: torch.dtype,
                  threads: int) -> tuple[Transformer, Path, TensorGroup]:
    """Rank 0's shard of the target, its followers started and holding theirs (worker/tp.py)."""
    from streamsd.model.presets import is_preset

    if is_preset(cfg.model):
        raise ModelLoadError("tensor parallelism loads a model directory or a .gguf file, not a preset")
    path = resolve_model(cfg.model)
    check_architecture(load_config(path))
    try:
        group, target = TensorGroup.start(path, cfg.tensor_parallel_size, device, dtype, threads)
    except ValueError as exc:  # the head counts do not divide
        raise ModelLoadError(str(exc)) from exc
    return target, path, group


def in_background(fn: Callable[..., T], *args: Any) -> Future[T]:
    """fn(*args) on a thread of its own; its result (or its exception) from `.result()`."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="streamsd-load")
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def use_triton_cache() -> None:
    """Triton's compiled kernels under $STREAMSD_HOME/triton, unless TRITON_CACHE_DIR says otherwise:
    beside the models, in the volume a container keeps, so that a restart loads the kernel variants
    the warm-up compiled instead of compiling them again. Triton reads the variable at each compile."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(streamsd_home() / "triton"))


def build_runtime(cfg: EngineConfig) -> Runtime:
    t0 = time.perf_counter()
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    world = cfg.tensor_parallel_size
    if world > 1 and device.type == "cuda" and cfg.spec.tree is not None:
        # The start-up profile times a tree step as a CUDA graph, which the follower ranks cannot join.
        raise ValueError("draft trees with tensor parallelism run on CPUs; on GPUs draft chains "
                         "(--speculative-tree none)")
    if device.type == "cuda":
        use_triton_cache()
        if world > 1:
            device = torch.device("cuda:0")  # rank r runs on cuda:r
    threads = cfg.cpu_threads or (max(1, (os.cpu_count() or 2) - 1) if world == 1 else default_threads(world))
    if device.type == "cpu":
        # OpenMP threads spin while they wait: on a busy machine (the event loop, HTTP clients, a
        # load generator on the same box) one spinning thread too many makes every matmul crawl.
        torch.set_num_threads(threads)
    if world == 1:
        if device.type == "cuda":
            torch.zeros(1, device=device)  # the device's context, timed apart from the weights
            log.info("%s started in %.2fs", torch.cuda.get_device_name(device), time.perf_counter() - t0)
        t1 = time.perf_counter()
        target, path = load_model(cfg.model, device, dtype)
        log.info("weights of %s on %s in %.2fs", path.name, device, time.perf_counter() - t1)
        return _build(cfg, t0, device, dtype, target, path, None)
    target, path, group = load_parallel(cfg, device, dtype, threads)
    try:
        return _build(cfg, t0, device, dtype, target, path, group)
    except BaseException:
        group.close()
        raise


def _build(cfg: EngineConfig, t0: float, device: torch.device, dtype: torch.dtype, target: Transformer, path: Path,
           group: TensorGroup | None) -> Runtime:
    # On a thread of its own while the head loads, the kernels compile and the graphs are captured: a
    # tokenizer read directly takes a fraction of a second, one read through transformers seconds
    # (model/tokenizer.py).
    loading = in_background(load_tokenizer, path)
    defaults = GenerationDefaults.read(path, cfg.generation_config)
    defaults.log_at_load(path / "generation_config.json")
    args, tree = target.args, cfg.spec.tree
    drafters = load_drafters(cfg, target, path, device, dtype, loading.result)
    num_blocks = kv_blocks(cfg, drafters.kv_bytes_per_token(target, dtype), device)
    # One block more than the scheduler counts: the scratch block CUDA-graph padding writes to.
    cache = group.kv_cache(target.layer_args, num_blocks + 1, BLOCK_SIZE, dtype) if group is not None \
        else PagedKVCache(target.layer_args, num_blocks + 1, BLOCK_SIZE, dtype, device)
    max_len = context_length(cfg, args, num_blocks, drafters.draft.args if drafters.draft else None)
    # Speculative steps queue ahead (worker/lookahead.py): an EAGLE head's chains or trees.
    ahead = drafters.head is not None and (device.type == "cuda" if cfg.pipeline is None else cfg.pipeline)
    queues_ahead = ahead and tree is None  # chains draft into each request's second q row meanwhile
    q_slots, q_pool = q_pool_for(cfg, drafters, args.vocab_size, device, queues_ahead)
    proposer = build_proposer(cfg, drafters, target, q_pool, num_blocks, device, dtype)
    margin = kv_margin(cfg.spec.num_tokens) if ahead else KVMargin(0, 0)  # what steps queued ahead write
    sched = scheduler_config(cfg, num_blocks, max_len, margin, proposer)
    worker = Worker(target, cache, proposer, q_pool, device, pipeline=cfg.pipeline, tree=tree, scratch_block=num_blocks,
                    exact=cfg.exact)
    if cfg.exact and device.type != "cuda":
        enable_exact_reference(target)
    if queues_ahead:
        sched = queue_chains(worker, sched, cfg.spec.num_tokens)
    if device.type == "cuda" and group is not None and drafters.draft is not None:
        use_kernels(drafters.draft, device)  # the target has them already (worker/tp.py); no graphs under tensor parallelism
    if device.type == "cuda" and group is None:
        kernels = worker.enable_cuda(scratch_block=num_blocks, max_len=max_len, k=cfg.spec.num_tokens,
                                     graphs=cfg.cuda_graphs, tree_max_batch=cfg.spec.max_batch, exact=cfg.exact)
        if cfg.cuda_graphs:  # while a first start's child processes compile the kernels' variants
            from streamsd.worker.cuda import capture_all

            t1 = time.perf_counter()
            try:
                log.info("captured %d CUDA graphs in %.1fs", capture_all(worker, sched.max_num_seqs),
                         time.perf_counter() - t1)
            except BaseException:
                kernels.cancel()
                raise
        log.info("compiled %d Triton kernel variants in %.1fs", *kernels.finish())
    policy = build_policy(cfg, worker, sched, (path, *drafters.dirs))
    tokenizer = loading.result()
    eos_ids = eos_ids_of(path, tokenizer, args)
    template = chat_template_of(cfg.chat_template, tokenizer)
    warm = warm_up(worker, sched, cfg.spec, eos_ids, q_slots, warm_up_chat_prompt(tokenizer, template))
    log.info("warmed up in %.2fs: %d steps, %d drafts", warm.seconds, warm.steps, warm.drafted)
    seconds = time.perf_counter() - t0
    _log_loaded(cfg, path, device, dtype, seconds, num_blocks, max_len, q_pool, q_slots, args.vocab_size)
    _freeze_heap()
    return Runtime(worker, tokenizer, args, sched, path, eos_ids, q_slots, seconds, policy,
                   Grammars(tokenizer, args.vocab_size), defaults, group, cfg.exact, template, cfg.seed)


def scheduler_config(cfg: EngineConfig, num_blocks: int, max_len: int, margin: KVMargin,
                     proposer: Proposer | None) -> SchedulerConfig:
    """The scheduler's limits for this engine: its KV blocks and context, the KV its drafts and the
    steps queued ahead write (`margin`), and what its prefix cache keeps for the proposer."""
    tree = cfg.spec.tree
    return SchedulerConfig(
        num_blocks=num_blocks,
        max_model_len=max_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=max(cfg.max_num_batched_tokens, 2 * (cfg.spec.num_tokens + 1)),
        max_queue=cfg.max_queue,
        drafting_reserve=margin.reserve,
        drafting_keep=margin.keep,
        draft_window=tree.frontier * (tree.depth - 1) if tree is not None else 0,
        whole_drafts=tree is not None,
        enable_prefix_caching=cfg.enable_prefix_caching,
        prefix_draft_kv=proposer is not None and proposer.keeps_cache,
        prefix_streams=proposer is not None and proposer.store is not None,
        prefix_next_tokens=proposer.kv_next_tokens if proposer is not None else 0,
    )


def _log_loaded(cfg: EngineConfig, path: Path, device: torch.device, dtype: torch.dtype, seconds: float,
                num_blocks: int, max_len: int, q_pool: torch.Tensor | None, q_slots: int, vocab: int) -> None:
    q_bytes = q_pool.numel() * q_pool.element_size() if q_pool is not None else 0
    log.info("loaded %s on %s (%s) in %.2fs: %d KV blocks, context %d, q pool %d slots x %d x %d = %.1f MiB; "
             "speculation: %s", path, device, dtype, seconds, num_blocks, max_len, q_slots, cfg.spec.num_tokens,
             vocab, q_bytes / 2**20,
             f"{cfg.spec.method}, k <= {cfg.spec.num_tokens}, {cfg.spec.policy}"
             + (f", trees {cfg.spec.tree}" if cfg.spec.tree else "")
             + (f", while at most {cfg.spec.max_batch} requests decode" if cfg.spec.max_batch else "")
             if cfg.spec.enabled else "none")


def _freeze_heap() -> None:
    """Everything loaded so far (modules, the tokenizer's vocabulary, graphs) lives as long as the
    process: frozen, a full collection no longer walks it, which made it a step-sized pause.

    A step allocates thousands of short-lived containers (per-request lists, outputs, token infos)
    that are freed by reference counting; at the default 700 net allocations the young generation
    was collected ~130 times per 64-token pass at B = 256, 20-37 ms per pass on an H200's host
    (2-3 % of it). Nearly everything dies young, so a larger threshold collects rarely, and briefly."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def queue_chains(worker: Worker, sched: SchedulerConfig, k: int) -> SchedulerConfig:
    """Speculative steps queued ahead (worker/lookahead.py) for a proposer that drafts on the device (an EAGLE
    head's chains, synthetic drafts): the KV a queued verify writes past its step's, and one k for the
    whole chain up to max_tokens (SchedulerConfig.drafts_past_max_tokens). Returns the scheduler's
    config for it."""
    worker.lookahead.queue_chains(sched.max_model_len)
    margin = kv_margin(k)
    return dataclasses.replace(sched, drafting_reserve=margin.reserve, drafting_keep=margin.keep,
                               drafts_past_max_tokens=True)


def build_policy(cfg: EngineConfig, worker: Worker, sched: SchedulerConfig,
                 model_dirs: tuple[Path, ...] = ()) -> SpeculationPolicy:
    """Fixed k, or the adaptive planner over a cost table profiled before any request (or read back
    from the profile cache, profile_cache.py: `model_dirs` are the files the profile ran)."""
    if cfg.spec.policy != "adaptive" or not cfg.spec.enabled or worker.proposer is None:
        return FixedPolicy(cfg.spec.max_batch)
    from streamsd.policy.profile_cache import cache_mode, load_or_profile
    from streamsd.worker.profile import profile_key, profile_worker

    t0 = time.perf_counter()
    limits = (worker, sched.max_num_seqs, sched.max_num_batched_tokens, cfg.spec.num_tokens)
    # Timed in the engine's own step shapes (B requests x 1 + k tokens, its CUDA graphs on a GPU).
    cost, source = load_or_profile(profile_key(*limits, list(model_dirs)), lambda: profile_worker(*limits),
                                   home=streamsd_home(), mode=cache_mode(cfg.profile_cache))
    shape = cost.shape
    log.info("adaptive speculation, %s in %.1fs, ms per step (batch: per width %s): %s",
             f"cost profile read from {source}" if source else "profiled", time.perf_counter() - t0,
             shape.widths if shape else (),
             {b: [round(t * 1e3, 2) for t in row] for b, row in zip(shape.batches, shape.values, strict=True)}
             if shape else {})
    if cfg.spec.tree is not None:
        graphs = worker.tree_graphs  # past its largest bucket a tree step runs eagerly
        return tree_chooser(cost, cfg.spec.tree, graphs.buckets[-1] if graphs is not None else 0)
    return adaptive_policy(cfg.spec.num_tokens, cost, worker)


def tree_chooser(cost: CostTable, tree: TreeShape, max_batch: int = 0) -> TreeChooser:
    """The step chooser of a tree engine (policy/chooser.py), its switch points logged: the τ (tokens
    per tree step) above which trees beat plain steps, per batch bucket; no trees past `max_batch`
    (0: no limit)."""
    chooser = TreeChooser(cost, tree.depth, max_batch=max_batch)
    log.info("draft trees %s chosen per step: tree step ms by batch %s; trees pay where tokens per tree step "
             "exceed, by batch, %s; at the prior %.2f, up to batch %d", tree,
             {b: round(t * 1e3, 2) for b, t in zip(cost.tree.keys, cost.tree.values, strict=True)},
             chooser.switch_points(), chooser.prior_tau, chooser.largest_tree_batch())
    return chooser


def adaptive_policy(max_k: int, cost: CostTable, worker: Worker) -> AdaptivePolicy:
    """The adaptive policy over `cost` for this worker's proposer and pipelining."""
    proposer = worker.proposer
    return AdaptivePolicy(max_k, cost, draft_has_cache=proposer is not None and proposer.keeps_cache,
                          settled_lag=1 if worker.hidden_layers else 0,
                          queues_ahead=worker.lookahead.queues_speculative,
                          depth_steps=proposer.depth_steps if proposer is not None else (),
                          short_drafts_fail=proposer is not None and proposer.may_propose_fewer)
