"""A running `streamsd serve` asked the way a user would: streamed chats at T=0 and T=1 at once, a
bad request, then the server's speculation counters. Standard library only (the device machine has
no `openai` package): SSE lines over urllib.

Usage: python scripts/serve_smoke.py [--base-url http://127.0.0.1:8000] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def chat(base: str, content: str, temperature: float, max_tokens: int, seed: int) -> tuple[str, float, int]:
    """(text, seconds, streamed chunks) of one streamed chat completion."""
    body = json.dumps({"model": "smollm2-135m-instruct", "stream": True, "temperature": temperature, "seed": seed,
                       "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0, text, chunks = time.perf_counter(), [], 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            text.append(delta)
            chunks += 1
    return "".join(text), time.perf_counter() - t0, chunks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=8)
    a = p.parse_args()
    base = a.base_url
    text, s, _ = chat(base, "What is the capital of France?", 0.0, 20, 0)
    print(f"T=0 capital of France ({s:.2f}s): {text!r}")
    assert "Paris" in text
    questions = ["Write a haiku about the sea.", "Explain recursion in two sentences.", "List three prime numbers.",
                 "What does a compiler do?"]
    with ThreadPoolExecutor(a.clients) as pool:
        jobs = [pool.submit(chat, base, questions[i % 4], (0.0, 1.0)[i % 2], 128, i) for i in range(a.clients)]
        for i, job in enumerate(jobs):
            text, s, chunks = job.result()
            print(f"client {i} T={(0.0, 1.0)[i % 2]:g}: {chunks} chunks in {s:.2f}s, {len(text)} chars")
            assert text
    bad = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(
        {"model": "smollm2-135m-instruct", "max_tokens": -3, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(bad, timeout=30)
        raise AssertionError("max_tokens=-3 was accepted")
    except urllib.error.HTTPError as e:
        print(f"bad request -> {e.code} {json.loads(e.read())['error']['message']!r}")
        assert 400 <= e.code < 500
    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    for line in metrics.splitlines():
        if line.startswith(("streamsd:spec_decode_num_draft_tokens_total", "streamsd:spec_decode_num_accepted_tokens_total")):
            print(line)
    print("serve smoke: ok")


if __name__ == "__main__":
    main()
