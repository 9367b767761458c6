"""`streamsd bench overhead`: what serving over HTTP costs, measured side by side in one run.

Two copies of the same engine, built from the same `streamsd serve` flags (`--serve-args`, read by
engine/args.py as the server reads them): one in this process behind the asyncio engine the server
runs (its event loop and worker thread, no HTTP), one inside `streamsd serve` on 127.0.0.1, read
over SSE. The same greedy chat requests (by default the shipped held-out prompts) at batch 1
alternate between them, so both see the same machine load. Reported: median TTFT and TPOT of each
and the difference (the server's TTFT includes the HTTP request, the chat template and the
tokenizer; the engine's starts from token ids), and how many answers came out token for token alike
(always, in float32 on a CPU; in bf16 on a GPU two engines whose policies timed their steps
differently can verify different widths, and near-ties may part).

On a GPU the two engines share the device: unless the flags size the KV cache
(`--gpu-memory-utilization`, `--kv-cache-tokens`), each is given GPU_SHARE of its memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx

from streamsd.bench.client import parse_sse_line, session, sse_lines
from streamsd.bench.datasets import CHAT_PROMPTS, load_dataset

if TYPE_CHECKING:
    from streamsd.engine.async_engine import AsyncEngine

GPU_SHARE = 0.4  # of the GPU's memory for each engine, when the flags leave the KV cache unsized


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve-args", default="", metavar="FLAGS",
                   help="the `streamsd serve` engine flags both sides are built from, as one string, e.g. "
                        "\"--speculative-tree 5,8,8,40\" (default: none, the server's own defaults)")
    p.add_argument("--dataset", default=str(CHAT_PROMPTS),
                   help="the prompts (first turns), as `bench serve` reads them (default: the shipped held-out chat prompts)")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per pass, from the dataset's start")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="measured passes over the prompt set (after one warm-up)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="the server runs its engine in a process of its own, or not (serve --[no-]engine-process; "
                        "default: as serve, on with a GPU): with it, the hop between the two processes is counted")
    p.add_argument("--port", type=int, default=8787, help="port of the server it starts")
    p.add_argument("--output-json", default=None, help="write the figures as JSON here")


@dataclass(frozen=True, slots=True)
class Timing:
    ttft_s: float
    tpot_s: float
    tokens: list[int]


def engine_flags(serve_args: str) -> tuple[list[str], argparse.Namespace]:
    """The flags for both sides (GPU_SHARE added on CUDA where they leave the KV cache unsized) and
    their reading; a flag that is not an engine flag (--port is the benchmark's) is refused."""
    from streamsd.engine.args import DEFAULT_MODEL, add_engine_args
    from streamsd.engine.builder import pick_device

    parser = argparse.ArgumentParser(prog="--serve-args", exit_on_error=False)
    add_engine_args(parser, model_default=DEFAULT_MODEL)
    flags = shlex.split(serve_args)
    try:
        ns, unknown = parser.parse_known_args(flags)
    except argparse.ArgumentError as exc:
        raise ValueError(f"--serve-args: {exc}") from exc
    if unknown:
        raise ValueError(f"--serve-args takes the engine flags of `streamsd serve`; not {' '.join(unknown)}")
    if pick_device(ns.device).type == "cuda" and ns.gpu_memory_utilization is None and ns.kv_cache_tokens is None:
        flags += ["--gpu-memory-utilization", str(GPU_SHARE)]
        ns = parser.parse_args(flags)
    return flags, ns


def _start_server(flags: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """`streamsd serve` with `flags`, its output into `log` (quoted in the error if it never gets ready)."""
    cmd = [sys.executable, "-m", "streamsd.cli", "--log-level", "warning", "serve", *flags, "--port", str(port)]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready: " + " | ".join(tail))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not become healthy")


async def _build_engine(ns: argparse.Namespace) -> AsyncEngine:
    """The engine as the server builds it: on the worker thread its steps then run on."""
    from functools import partial

    from streamsd.engine.args import engine_config
    from streamsd.engine.async_engine import AsyncEngine
    from streamsd.engine.core import build_engine_core

    def lost(message: str) -> None:  # a rank lost: the next step raises it, failing the benchmark's request
        pass

    engine = await AsyncEngine.launch(partial(build_engine_core, engine_config(ns)), 1, lost)
    await engine.start()
    return engine


async def _engine_one(engine: AsyncEngine, prompt: str, max_tokens: int) -> Timing:
    from streamsd.request import SamplingParams

    ids = engine.core.text.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    async for out in engine.generate(ids, params):
        if out.error:
            raise RuntimeError(f"the engine failed a request: {out.error}")
        if out.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += out.token_ids
    return _timing(t0, first, last, tokens)


async def _served_one(client: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> Timing:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = 0.0
    tokens: list[int] = []
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in sse_lines(r):
            chunk = parse_sse_line(line)
            if not isinstance(chunk, dict):
                continue
            ids = [t["id"] for t in chunk["choices"][0]["streamsd"]["tokens"]] if chunk["choices"] else []
            if ids:
                last = time.perf_counter()
                first = first or last
                tokens += ids
    return _timing(t0, first, last, tokens)


def _timing(t0: float, first: float, last: float, tokens: list[int]) -> Timing:
    if not tokens:
        raise RuntimeError("a request produced no tokens")
    return Timing(first - t0, (last - first) / max(len(tokens) - 1, 1), tokens)


async def measure(ns: argparse.Namespace, prompts: list[str], port: int, max_tokens: int,
                  repeats: int) -> tuple[list[Timing], list[Timing]]:
    """(engine, server) timings of every measured request, the two alternating."""
    engine = await _build_engine(ns)
    offline: list[Timing] = []
    served: list[Timing] = []
    try:
        async with session(1, 300.0) as client:
            for i, prompt in enumerate(prompts * (repeats + 1)):
                o = await _engine_one(engine, prompt, max_tokens)
                s = await _served_one(client, f"http://127.0.0.1:{port}", prompt, max_tokens)
                if i >= len(prompts):  # the first pass warms both up
                    offline.append(o)
                    served.append(s)
    finally:
        await engine.close()
    return offline, served


def summarize(offline: list[Timing], served: list[Timing]) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    for name, timings in (("engine", offline), ("server (SSE)", served)):
        rows[name] = {"ttft_ms": 1e3 * statistics.median(t.ttft_s for t in timings),
                      "tpot_ms": 1e3 * statistics.median(t.tpot_s for t in timings)}
    eng, sse = rows["engine"], rows["server (SSE)"]
    rows["server adds"] = {"ttft_ms": sse["ttft_ms"] - eng["ttft_ms"], "tpot_ms": sse["tpot_ms"] - eng["tpot_ms"]}
    identical = sum(o.tokens == s.tokens for o, s in zip(offline, served, strict=True))
    return {"rows": rows, "requests": len(served), "identical": identical}


def run(args: argparse.Namespace) -> int:
    from streamsd.engine.args import engine_process

    flags, ns = engine_flags(args.serve_args)
    prompts = [p.text for p in load_dataset(args.dataset, args.num_prompts)]
    process = engine_process(args.engine_process, ns.device)
    served_flags = [*flags, "--engine-process" if process else "--no-engine-process"]
    with tempfile.TemporaryDirectory(prefix="streamsd-overhead-") as tmp:
        try:
            proc = _start_server(served_flags, args.port, Path(tmp) / "serve.log")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            offline, served = asyncio.run(measure(ns, prompts, args.port, args.max_tokens, args.repeats))
        finally:
            proc.terminate()
            proc.wait(60)
    doc = summarize(offline, served)
    print(f"{'':14}{'TTFT ms':>10}{'TPOT ms':>10}   (serve {' '.join(served_flags)}; batch 1, "
          f"{args.max_tokens} tokens, median of {doc['requests']})")
    for name, r in doc["rows"].items():
        print(f"{name:14}{r['ttft_ms']:10.2f}{r['tpot_ms']:10.3f}")
    print(f"identical answers: {doc['identical']} of {doc['requests']}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"serve_args": flags, "engine_process": process,
                                                      "max_tokens": args.max_tokens, **doc}, indent=2))
    return 0
