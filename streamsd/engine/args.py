"""The engine's command-line flags and their reading into an EngineConfig, shared by `streamsd serve`,
`streamsd generate` and the benchmarks that build the same engine as the server (`bench overhead`):
the defaults that depend on the model and device (speculation method, draft tree) are resolved here."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from streamsd.config import EngineConfig, SpecMethod

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_K = 4  # --num-speculative-tokens
DEFAULT_TREE = "4,6,6,24"  # the default model's shipped head on CUDA (default_tree)


def add_engine_args(p: argparse.ArgumentParser, *, model_default: str | None) -> None:
    p.add_argument("--model", default=model_default, help=f"{DEFAULT_MODEL}, a local HF directory, a .gguf file or a hub id")
    p.add_argument("--draft-model", default=None, help="a small draft model with the same tokenizer, or an EAGLE head")
    p.add_argument("--speculative-method", choices=["draft", "ngram", "eagle", "none"], default=None,
                   help="default: draft with --draft-model; for the embedded default model its shipped EAGLE "
                        "head on CUDA, ngram on a CPU; else none")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_K, help="K, the most drafts verified per step")
    p.add_argument("--speculation-policy", choices=["adaptive", "fixed"], default=None,
                   help="adaptive (the default): k per request and step (with trees: a tree or a plain step) from "
                        "measured costs and acceptance; fixed: always K (or always the tree)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="as vLLM's: the speculation in one JSON object, e.g. '{\"method\": \"eagle3\", \"model\": "
                        "\"HEAD\", \"num_speculative_tokens\": 4}' (method ngram, eagle, eagle3 or draft_model; model; "
                        "num_speculative_tokens; prompt_lookup_max/min; disable_by_batch_size); instead of the flags above")
    p.add_argument("--speculative-tree", default=None, metavar="D,M,C,N",
                   help="EAGLE only: draft a tree per step instead of a chain: depth D, the M likeliest nodes of "
                        "each level expanded into their C likeliest children, the N likeliest nodes verified "
                        f"(e.g. 3,8,8,24); verified whole, or a plain step where the step chooser prices trees slower. Default: {DEFAULT_TREE} "
                        "for the embedded default model's shipped head on CUDA; 'none': chains")
    p.add_argument("--speculative-max-batch", type=int, default=None, metavar="N",
                   help="speculate only while at most N requests decode, plain steps above (0: always); given, "
                        "the policy is fixed (the adaptive policy and the tree chooser decide by themselves)")
    p.add_argument("--no-int8-draft-head", dest="int8_draft_head", action="store_false",
                   help="CUDA draft trees: rank drafts over the head's lm_head as it is, not an int8 copy")
    p.add_argument("--draft-greedy-threshold", type=float, default=0.75,
                   help="requests below this temperature draft greedily (one-hot q); others sample drafts")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; auto: $STREAMSD_DTYPE, else bfloat16 on CUDA and on CPUs with "
                        "native bf16, else float32")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the most requests decoding at once (the batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the most tokens one step runs (prefill chunks plus decode and verify tokens)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache capacity in tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="as vLLM's: the share of the GPU's memory the server may use (weights, KV cache, working "
                        "memory); default: all that is free once the weights are loaded. GPUs only; not with --kv-cache-tokens")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="as vLLM's: a Jinja chat template, or the file holding one, used instead of the tokenizer's "
                        "own (checked at start)")
    p.add_argument("--seed", type=int, default=None,
                   help="as vLLM's: requests without a seed draw theirs from a generator seeded with this, so a "
                        "restarted server answers the same sequence of requests alike (default: seeds from the OS)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the longest prompt + completion a request may have (default: the model's context length, "
                        "or what the KV cache holds if less); refused if the model or the cache cannot hold it")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of full blocks a request shares with earlier ones (a chat's earlier turns, "
                        "a common system prompt); --no-enable-prefix-caching computes every prompt whole")
    p.add_argument("--exact", action="store_true",
                   help="batch-invariant target forward: a token's logits are the same bits whatever else its step "
                        "holds, so greedy output is the same with or without speculation and at any batch "
                        "(chains by default, draft trees with --speculative-tree; costs throughput on CUDA, see "
                        "docs/benchmarks.md)")
    p.add_argument("--cpu-threads", type=int, default=None, help="CPU only: torch threads (default: cores - 1)")
    p.add_argument("--profile-cache", choices=["reuse", "refresh", "off"], default=None,
                   help="the adaptive policy's start-up cost profile, kept under $STREAMSD_HOME/profiles: reuse "
                        "it when the model, device, dtype and threads match, refresh it, or off (profile every "
                        "start); default: $STREAMSD_PROFILE_CACHE, else reuse")
    p.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: sampling fields a request leaves out (temperature, top_p, top_k, min_p) take the "
                        "model's generation_config.json values; none: ignore them (API defaults)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the target over N ranks (Megatron-style; one GPU each on CUDA); N must divide the "
                        "model's attention and kv heads. Speculation: an EAGLE head (chains on CUDA), a draft model or n-gram")
    p.add_argument("--pipeline", choices=["auto", "on", "off"], default="auto",
                   help="queue the next step (plain decode, EAGLE verify) on the device before reading this "
                        "one; auto: on CUDA, where the GPU runs ahead of the host")


def engine_process(flag: bool | None, device: str | None) -> bool:
    """`serve --[no-]engine-process`, else the default: on a GPU the server's event loop and the
    engine's each get an interpreter of their own (many concurrent streams are host-bound there); on
    the CPU the model's compute sets the pace, and a second process only takes cores from it."""
    from streamsd.engine.builder import pick_device

    return flag if flag is not None else pick_device(device).type == "cuda"


def default_speculation(model: str, draft_model: str | None, device: str | None) -> SpecMethod | Literal["none"]:
    """--speculative-method when none is given. For the embedded default model: its shipped EAGLE head
    on CUDA (batch 1 on an H200, 16 held-out prompts, against pipelined plain steps: 1.46x plain at
    T=0, 0.88x at T=1; n-gram 1.08x and 0.75x) and n-gram lookup on a CPU, where the head's extra
    layer and its full-vocabulary lm_head cost more than they save (this 2-core machine, T=0: eagle 1.04x plain against n-gram's 1.37x
    in float32, 1.25x against 1.77x in bfloat16)."""
    if draft_model:
        return "draft"
    if model != DEFAULT_MODEL:
        return "none"
    from streamsd.engine.builder import pick_device

    return "eagle" if pick_device(device).type == "cuda" else "ngram"


def default_tree(a: argparse.Namespace, method: str) -> str | None:
    """--speculative-tree when none is given: DEFAULT_TREE for the embedded default model's shipped head
    on CUDA, unless a chain setting was asked for (a policy, K, another head), exact mode, or tensor
    parallelism, whose GPUs draft chains (engine/builder.py). Exact mode verifies trees as it does chains
    when asked (--speculative-tree), but its tree steps attend one token a program, prompt chunks sharing
    the step included, so chains are its default. On an H200 at batch 1
    (16 held-out prompts x 256 tokens) it reads 2.6x plain at T=0 and 2.1x at T=1, the adaptive chain
    ~1x (docs/benchmarks.md)."""
    from streamsd.engine.builder import pick_device

    if a.speculative_tree is not None:
        return None if a.speculative_tree == "none" else a.speculative_tree
    chain_asked = a.speculation_policy is not None or a.num_speculative_tokens != DEFAULT_K or a.exact \
        or a.tensor_parallel_size > 1
    if method != "eagle" or a.model != DEFAULT_MODEL or a.draft_model or chain_asked:
        return None
    return DEFAULT_TREE if pick_device(a.device).type == "cuda" else None


def _with_speculative_config(a: argparse.Namespace) -> tuple[argparse.Namespace, dict[str, int]]:
    """The flags with vLLM's --speculative-config read into them (refused beside the flags it sets), and
    the n-gram window it asks for (SpecConfig's ngram_max / ngram_min)."""
    from streamsd import speculative_config

    if a.speculative_config is None:
        return a, {}
    opts = speculative_config.parse(a.speculative_config)
    given = [flag for flag, set_ in (("--speculative-method", a.speculative_method is not None),
                                     ("--draft-model", a.draft_model is not None),
                                     ("--num-speculative-tokens", a.num_speculative_tokens != DEFAULT_K),
                                     ("--speculative-max-batch", a.speculative_max_batch is not None)) if set_]
    if given:
        raise ValueError(f"--speculative-config sets the speculation: leave out {', '.join(given)}")
    flags = argparse.Namespace(**{**vars(a), "speculative_method": opts.method, "draft_model": opts.draft_model,
                                  "num_speculative_tokens": opts.num_tokens or DEFAULT_K,
                                  "speculative_max_batch": opts.max_batch,
                                  # vLLM's EAGLE drafts chains of num_speculative_tokens: no default tree
                                  "speculative_tree": a.speculative_tree or "none"})
    window = {k: v for k, v in (("ngram_max", opts.ngram_max), ("ngram_min", opts.ngram_min)) if v is not None}
    return flags, window


def engine_config(a: argparse.Namespace, max_queue: int = 1024) -> EngineConfig:
    """The engine `a` asks for (flags of add_engine_args): the speculation defaults resolved here, once."""
    from streamsd.config import EngineConfig, SpecConfig, TreeShape

    a, window = _with_speculative_config(a)
    method: SpecMethod | Literal["none"] = a.speculative_method or default_speculation(a.model, a.draft_model, a.device)
    shape = default_tree(a, method)
    tree = TreeShape.parse(shape) if shape else None
    max_batch = a.speculative_max_batch or 0
    # A gate asked for with no policy means the fixed one (the adaptive policy and the chooser gate themselves).
    gated = bool(max_batch) and a.speculation_policy is None
    policy: Literal["adaptive", "fixed"] = "fixed" if gated else a.speculation_policy or "adaptive"
    spec = SpecConfig(method=None if method == "none" else method,
                      num_tokens=tree.nodes if tree else a.num_speculative_tokens, draft_model=a.draft_model,
                      draft_greedy_threshold=a.draft_greedy_threshold, policy=policy, tree=tree,
                      int8_draft_head=a.int8_draft_head, max_batch=max_batch, **window)
    return EngineConfig(model=a.model, spec=spec, device=a.device, dtype=a.dtype, kv_cache_tokens=a.kv_cache_tokens,
                        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                        max_queue=max_queue, cpu_threads=a.cpu_threads, pipeline={"on": True, "off": False}.get(a.pipeline),
                        profile_cache=a.profile_cache, generation_config=a.generation_config,
                        enable_prefix_caching=a.enable_prefix_caching, exact=a.exact,
                        tensor_parallel_size=a.tensor_parallel_size, max_model_len=a.max_model_len,
                        gpu_memory_utilization=a.gpu_memory_utilization, chat_template=a.chat_template, seed=a.seed)
