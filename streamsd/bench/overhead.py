"""`streamsd bench overhead`: what the HTTP/SSE layer costs, measured side by side in one run.

The same model, the same greedy requests at batch 1, alternating: one through the engine core in
this process (no server), the same one through `streamsd serve` (a subprocess on 127.0.0.1) over
SSE, so both see the same machine load. Reports median TTFT and TPOT for both and the difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["Tell me about the history of Paris.", "Write a short poem about the sea.",
           "Explain speculative decoding in two sentences.", "List five prime numbers and why they are prime."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model to serve and run")
    p.add_argument("--speculative-method", default="ngram", choices=["ngram", "none"], help="speculation of both runs")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--repeats", type=int, default=2, help="measured passes over the prompt set (after one warm-up)")
    p.add_argument("--port", type=int, default=8787, help="port of the server it starts")
    p.add_argument("--output-json", default=None, help="write the figures as JSON here")


def _offline_core(args: argparse.Namespace):
    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime
    from streamsd.engine.core import EngineCore

    spec = SpecConfig(method=None if args.speculative_method == "none" else args.speculative_method)
    return EngineCore(build_runtime(EngineConfig(model=args.model, spec=spec, device=args.device)), spec)


def _offline_one(core, prompt: str, max_tokens: int, rid: str) -> tuple[float, float]:
    from streamsd.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    core.add_request(rid, core.encode_chat([{"role": "user", "content": prompt}]), params)
    first = last = None
    n = 0
    while core.has_work:
        for out in core.step():
            if out.token_ids:
                first = first or time.perf_counter()
                last = time.perf_counter()
                n += len(out.token_ids)
    assert first is not None and last is not None
    return first - t0, (last - first) / max(n - 1, 1)


def _start_server(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "streamsd.cli", "--log-level", "warning", "serve", "--model", args.model,
           "--speculative-method", args.speculative_method, "--port", str(args.port)]
    if args.device:
        cmd += ["--device", args.device]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not become healthy")


def _served_one(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, float]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            k = len(chunk["choices"][0]["streamsd"]["tokens"]) if chunk["choices"] else 0
            if k:
                first = first or time.perf_counter()
                last = time.perf_counter()
                n += k
    assert first is not None and last is not None
    return first - t0, (last - first) / max(n - 1, 1)


def run(args: argparse.Namespace) -> int:
    proc = _start_server(args)
    offline, served = [], []
    try:
        core = _offline_core(args)
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300) as client:
            for i, prompt in enumerate(PROMPTS * (args.repeats + 1)):
                o = _offline_one(core, prompt, args.max_tokens, f"o{i}")
                s = _served_one(client, prompt, args.max_tokens)
                if i >= len(PROMPTS):  # the first pass warms both up
                    offline.append(o)
                    served.append(s)
    finally:
        proc.terminate()
        proc.wait(60)
    rows: dict[str, dict[str, float]] = {}
    for name, timings in (("offline engine", offline), ("SSE server", served)):
        rows[name] = {"ttft_ms": 1e3 * statistics.median(x for x, _ in timings),
                      "tpot_ms": 1e3 * statistics.median(y for _, y in timings)}
    off, sse = rows["offline engine"], rows["SSE server"]
    rows["HTTP overhead"] = {"ttft_ms": sse["ttft_ms"] - off["ttft_ms"], "tpot_ms": sse["tpot_ms"] - off["tpot_ms"]}
    print(f"{'':18}{'TTFT ms':>10}{'TPOT ms':>10}   ({args.model}, batch 1, {args.speculative_method}, "
          f"{args.max_tokens} tokens, median of {len(served)})")
    for name, r in rows.items():
        print(f"{name:18}{r['ttft_ms']:10.2f}{r['tpot_ms']:10.3f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))
    return 0
