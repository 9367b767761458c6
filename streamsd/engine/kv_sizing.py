"""How much KV cache an engine gets (tokens given, a share of the GPU's memory, or a CPU default), and
so the longest sequence it holds."""

from __future__ import annotations

import torch

from streamsd.config import BLOCK_SIZE, EngineConfig
from streamsd.model.arch import ModelArgs

CPU_DEFAULT_KV_TOKENS = 16384


def kv_blocks(cfg: EngineConfig, bytes_per_token: int, device: torch.device) -> int:
    """The KV pool's blocks for `bytes_per_token` (every cache of a token: the target's, the drafter's, streams)."""
    if cfg.kv_cache_tokens:
        tokens = cfg.kv_cache_tokens
    elif device.type == "cuda":
        # The per-process share is kept per device index; a bare "cuda" means the current device.
        index = torch.cuda.current_device() if device.index is None else device.index
        free, total = torch.cuda.mem_get_info(index)
        free = process_free(free, total, torch.cuda.get_per_process_memory_fraction(index),
                            torch.cuda.memory_reserved(index))
        tokens = kv_cache_bytes(free, total, cfg.gpu_memory_utilization, cfg.kv_cache_memory_fraction) // bytes_per_token
    elif cfg.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization sizes a GPU's KV cache; on a CPU give --kv-cache-tokens")
    else:
        tokens = CPU_DEFAULT_KV_TOKENS
    return max(tokens // BLOCK_SIZE, 1)


def process_free(free: int, total: int, fraction: float, reserved: int) -> int:
    """What this process may still take of the `free` bytes: a process limited to a `fraction` of the GPU
    (torch.cuda.set_per_process_memory_fraction: several engines, or an engine inside a larger program,
    sharing one GPU) has that share of `total` less what its allocator holds `reserved` already."""
    return max(min(free, int(fraction * total) - reserved), 0)


def kv_cache_bytes(free: int, total: int, utilization: float | None, fraction: float) -> int:
    """The KV cache's bytes on a GPU with `free` of `total` bytes free once the weights are loaded: a
    `fraction` of what the server may still use, which is everything free, or with vLLM's
    `--gpu-memory-utilization` that share of the whole memory less what is in use already (the rest
    of the fraction is the steps' working memory and the CUDA graphs)."""
    budget = free if utilization is None else min(free, int(utilization * total) - (total - free))
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} leaves no memory for the KV cache: "
                         f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are in use already")
    return int(budget * fraction)


def context_length(cfg: EngineConfig, args: ModelArgs, num_blocks: int, draft: ModelArgs | None = None) -> int:
    """The longest sequence (prompt + answer) this engine holds: the least of the model's context, the
    KV pool's tokens, a draft model's context and the configured cap; `--max-model-len` may only lower it."""
    limits = {"the model's context": args.max_position, "the KV cache": num_blocks * BLOCK_SIZE}
    if draft is not None:
        limits["the draft model's context"] = draft.max_position
    max_len = min(*limits.values(), cfg.context_cap or args.max_position)
    if cfg.max_model_len is None:
        return max_len
    if cfg.max_model_len > max_len:
        raise ValueError(f"--max-model-len {cfg.max_model_len} is more than this engine can hold: {max_len} tokens ("
                         + ", ".join(f"{name} {n}" for name, n in limits.items()) + ")")
    return cfg.max_model_len
