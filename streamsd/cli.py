"""`streamsd serve | generate | pull | bench` — the command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from streamsd.config import STREAMS_PER_STEP, StreamInterval
from streamsd.engine.args import DEFAULT_MODEL, add_engine_args, engine_config, engine_process

if TYPE_CHECKING:
    from streamsd.config import EngineConfig
    from streamsd.engine.core import EngineCore


def default_web_dir() -> Path:
    """The chat UI: shipped as streamsd.web when installed, the top-level web/ in a checkout."""
    spec = importlib.util.find_spec("streamsd.web")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "index.html").exists():
            return Path(location)
    return Path(__file__).resolve().parent.parent / "web"


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
    from streamsd.engine.core import build_engine_core
    from streamsd.server.serve import serve
    from streamsd.server.state import ServerState

    cfg = engine_config(a, a.max_queue)
    name = a.served_model_name or (a.model if a.model == DEFAULT_MODEL else Path(a.model).name or a.model)
    state = ServerState(served_model_name=name, api_keys=keys, max_queue=a.max_queue, drain_timeout=a.drain_timeout,
                        stream_interval=a.stream_interval)
    web = Path(a.web_dir) if a.web_dir else default_web_dir()
    return serve(state, partial(build_engine_core, cfg), a.host, a.port, web, a.log_level,
                 access_log_enabled=a.access_log, origins=origins, tls=tls,
                 engine_process=engine_process(a.engine_process, a.device))


def cmd_generate(a: argparse.Namespace) -> int:
    from streamsd.engine.core import build_engine_core

    cfg = engine_config(a)
    core = build_engine_core(cfg)
    try:
        return _generate(core, a, cfg)
    finally:
        core.close()


def _generate(core: EngineCore, a: argparse.Namespace, cfg: EngineConfig) -> int:
    # Unset sampling flags take the model's defaults, else greedy decoding.
    params = core.rt.generation_defaults.sampling_params(temperature=a.temperature, top_p=a.top_p,
                                                        fallback_temperature=0.0, max_tokens=a.max_tokens,
                                                        seed=a.seed)
    ids = core.text.encode_chat([{"role": "user", "content": a.prompt}]) if a.chat else core.text.encode_prompt(a.prompt)
    core.add_request("cli", ids, params)
    t0, first, n, stats = time.perf_counter(), None, 0, None
    for turn in core.run():  # pipelined as a server's steps are: each step's text while the next one runs
        for out in turn.outputs:
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
    "overhead": ("the HTTP layer's cost: TTFT/TPOT of an engine in process against the same one served over SSE",
                 "streamsd.bench.overhead", "streamsd.bench.overhead"),
}


def _stream_interval(text: str) -> StreamInterval:
    return "auto" if text == "auto" else _at_least_one(text)


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamsd", description="Streaming LLM server with lossless speculative decoding")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="how much streamsd and the server log")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI API, the WebSocket protocol and the web UI")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    add_engine_args(s, model_default=DEFAULT_MODEL)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the model's name)")
    s.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond this get 429")
    s.add_argument("--stream-interval", type=_stream_interval, default=1, metavar="N|auto",
                   help="stream each answer's tokens N at a time (its first token at once, its last whatever is "
                        "left): fewer, larger chunks cost the server less at high concurrency; auto: 1 while at most "
                        f"{STREAMS_PER_STEP} answers stream, one more for each further {STREAMS_PER_STEP} "
                        "(default: 1, every step)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine (scheduling, detokenising, the model's steps) in a process of its own, "
                        "beside the one that serves HTTP and WebSockets: at high concurrency neither waits for "
                        "the other's Python work (default: on with a GPU, off on the CPU)")
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
    add_engine_args(g, model_default=DEFAULT_MODEL)
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
