"""`streamsd serve | generate | pull | bench` — the command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from streamsd.config import EngineConfig, SpecMethod
    from streamsd.engine.core import EngineCore

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_K = 4  # --num-speculative-tokens
DEFAULT_TREE = "4,6,6,24"  # the default model's shipped head on CUDA (default_tree)


def default_web_dir() -> Path:
    """The chat UI: shipped as streamsd.web when installed, the top-level web/ in a checkout."""
    spec = importlib.util.find_spec("streamsd.web")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "index.html").exists():
            return Path(location)
    return Path(__file__).resolve().parent.parent / "web"


def _add_engine_args(p: argparse.ArgumentParser, *, model_default: str | None) -> None:
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


def _engine_config(a: argparse.Namespace, max_queue: int = 1024):
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


def _security(a: argparse.Namespace):
    """The keys, origins and TLS files of `serve`, checked before anything loads."""
    from streamsd.server.auth import ApiKeys
    from streamsd.server.origins import OriginPolicy
    from streamsd.server.serve import Tls

    specs = [*(a.api_key or []), *(ApiKeys.read_file(a.api_key_file) if a.api_key_file else [])]
    if a.api_key_file and not specs[len(a.api_key or []):]:
        raise ValueError(f"--api-key-file {a.api_key_file} holds no key")
    keys = ApiKeys.parse(specs) if specs else None
    origins = OriginPolicy.parse(a.allowed_origins, a.allowed_methods, a.allowed_headers)
    if bool(a.ssl_certfile) != bool(a.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    if a.ssl_ca_certs and not a.ssl_certfile:
        raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
    tls = Tls(a.ssl_certfile, a.ssl_keyfile, a.ssl_ca_certs) if a.ssl_certfile else None
    return keys, origins, tls


def _model_tag(a: argparse.Namespace) -> argparse.Namespace:
    """`streamsd serve MODEL` as `--model MODEL`; both, naming different models, are refused."""
    if a.model_tag is None:
        return a
    if a.model != DEFAULT_MODEL and a.model != a.model_tag:
        raise ValueError(f"serve got two models: {a.model_tag} and --model {a.model}")
    return argparse.Namespace(**{**vars(a), "model": a.model_tag})


def cmd_serve(a: argparse.Namespace) -> int:
    a = _model_tag(a)
    keys, origins, tls = _security(a)
    from streamsd.engine.builder import build_runtime
    from streamsd.engine.core import EngineCore
    from streamsd.server.serve import serve
    from streamsd.server.state import ServerState

    cfg = _engine_config(a, a.max_queue)
    name = a.served_model_name or (a.model if a.model == DEFAULT_MODEL else Path(a.model).name or a.model)
    state = ServerState(served_model_name=name, api_keys=keys, max_queue=a.max_queue, drain_timeout=a.drain_timeout)
    web = Path(a.web_dir) if a.web_dir else default_web_dir()
    return serve(state, lambda: EngineCore(build_runtime(cfg), cfg.spec), a.host, a.port, web, a.log_level,
                 access_log_enabled=a.access_log, origins=origins, tls=tls)


def cmd_generate(a: argparse.Namespace) -> int:
    from streamsd.engine.builder import build_runtime
    from streamsd.engine.core import EngineCore

    cfg = _engine_config(a)
    core = EngineCore(build_runtime(cfg), cfg.spec)
    try:
        return _generate(core, a, cfg)
    finally:
        core.close()


def _generate(core: EngineCore, a: argparse.Namespace, cfg: EngineConfig) -> int:
    # Unset sampling flags take the model's defaults, else greedy decoding.
    params = core.rt.generation_defaults.sampling_params(temperature=a.temperature, top_p=a.top_p,
                                                        fallback_temperature=0.0, max_tokens=a.max_tokens,
                                                        seed=a.seed)
    ids = core.encode_chat([{"role": "user", "content": a.prompt}]) if a.chat else core.encode_prompt(a.prompt)
    core.add_request("cli", ids, params)
    t0, first, n, stats = time.perf_counter(), None, 0, None
    while core.has_work:
        for out in core.step():
            if out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
            first = first or (time.perf_counter() if out.token_ids else None)
            n += len(out.token_ids)
            sys.stdout.write(out.text)
            sys.stdout.flush()
            stats = out.stats or stats
    dt = time.perf_counter() - t0
    s = stats
    print(f"\n[{n} tokens in {dt:.2f}s: {n / dt:.1f} tok/s, TTFT {((first or t0) - t0) * 1e3:.0f} ms"
          + (f", acceptance {s.acceptance_rate:.1%}, mean accepted length {s.mean_accepted_length:.2f}"
             if s and s.drafted else ", no speculation") + f" ({cfg.spec.method or 'plain'})]")
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from streamsd.model.loader import resolve_model

    print(resolve_model(a.model))
    return 0


# name -> (what it measures, module with add_arguments, module with run): the options live apart from
# the benchmark where the benchmark imports torch, so that `--help` stays quick.
BENCH = {
    "offline": ("the engine alone: TPOT and tokens/s per batch size against the HBM floor and HF transformers",
                "streamsd.bench.offline_args", "streamsd.bench.offline"),
    "chat": ("real chat answers at batch 1: plain vs n-gram vs EAGLE chains and trees vs HF, per temperature",
             "streamsd.bench.chat_args", "streamsd.bench.chat"),
    "serve": ("a running server over HTTP: latency and throughput per concurrency, speculation off and on",
              "streamsd.bench.serve", "streamsd.bench.serve"),
    "soak": ("reliability: many clients for a while, with disconnects and bad input; checks nothing leaks",
             "streamsd.bench.soak", "streamsd.bench.soak"),
    "overhead": ("the HTTP layer's cost: TTFT/TPOT of the engine alone against through SSE",
                 "streamsd.bench.overhead", "streamsd.bench.overhead"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamsd", description="Streaming LLM server with lossless speculative decoding")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="how much streamsd and the server log")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI API, the WebSocket protocol and the web UI")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    _add_engine_args(s, model_default=DEFAULT_MODEL)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the model's name)")
    s.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond this get 429")
    s.add_argument("--api-key", action="append", default=None, metavar="[NAME:]KEY",
                   help="require this bearer token on the API (default: no authentication); repeat it for "
                        "several keys; /metrics counts each key's requests under NAME, else key-N (its position)")
    s.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more API keys, one [NAME:]KEY per line (# comments and blank lines skipped), after "
                        "those of --api-key")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma list of web origins (scheme://host[:port], or *) besides the server's own that may "
                        "open the WebSocket; turns CORS on for them on the HTTP API (default: none, CORS off)")
    s.add_argument("--allowed-methods", default=None, metavar="METHODS",
                   help="CORS: comma list of HTTP methods listed origins may use (default: GET,POST)")
    s.add_argument("--allowed-headers", default=None, metavar="HEADERS",
                   help="CORS: comma list of request headers listed origins may send (default: *, any)")
    s.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve https and wss with this PEM certificate (chain); needs --ssl-keyfile")
    s.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the certificate's PEM private key")
    s.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="require a client certificate signed by one of these PEM CA certificates")
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds streams get to finish on SIGTERM")
    s.add_argument("--web-dir", default=None, help="serve the chat UI from this directory instead of the shipped one")
    s.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no log line per HTTP request and WebSocket connect (API keys in URLs are always redacted)")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal")
    _add_engine_args(g, model_default=DEFAULT_MODEL)
    g.add_argument("--prompt", required=True, help="the text to continue (or, with --chat, the user's message)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="the most tokens to generate")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0: greedy); default: the model's, else 0")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: keep the likeliest tokens up to this mass; default: the model's, else 1")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("pull", help="fetch and convert a model; prints its directory last")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (the default), a .gguf file or a hub id")
    p.set_defaults(func=cmd_pull)

    from streamsd.train import cli as train_eagle

    t = sub.add_parser("train-draft", help="train an EAGLE draft head for a model by self-distillation")
    train_eagle.add_arguments(t)
    t.set_defaults(func=train_eagle.run)

    b = sub.add_parser("bench", help="benchmarks: offline (engine), chat (batch-1 answers), serve (a server), "
                                     "soak (reliability), overhead (HTTP layer)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, (summary, args_module, run_module) in BENCH.items():
        bp = bsub.add_parser(name, help=summary, description=summary)
        try:
            importlib.import_module(args_module).add_arguments(bp)
        except ImportError as exc:
            bp.set_defaults(func=lambda a, exc=exc: _missing(exc))
            continue
        bp.set_defaults(func=lambda a, run_module=run_module: _run_bench(run_module, a))
    return parser


def _run_bench(module: str, a: argparse.Namespace) -> int:
    try:
        run = importlib.import_module(module).run
    except ImportError as exc:
        return _missing(exc)
    return int(run(a) or 0)


def _missing(exc: ImportError) -> int:
    print(f"error: this benchmark needs a package that is not installed: {exc}", file=sys.stderr)
    return 2


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs a line per request at info: thousands from a benchmark's client, which reports them itself.
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from streamsd.model.loader import ModelLoadError

        if not isinstance(exc, ValueError | OSError | ModelLoadError):
            raise
        print(f"error: {exc}", file=sys.stderr)  # bad flags, a model that cannot load: one clear line, no traceback
        return 2


if __name__ == "__main__":
    sys.exit(main())
