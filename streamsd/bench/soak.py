"""`streamsd bench soak`: many concurrent SSE and WebSocket clients against a loopback server,
some cutting their connection mid-stream, some sending malformed requests. Every request is
greedy with a fixed seed, so each stream's text must equal its prompt's known answer (fetched
alone, non-streaming, before the load). After the load drains, /metrics must show no running
request and no KV cache in use.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp
from tqdm import tqdm

from streamsd.bench import report
from streamsd.bench.client import (
    BenchError,
    auth_headers,
    complete,
    first_model,
    session,
    stream_sse,
)
from streamsd.bench.soak_inputs import SOAK_PROMPTS, pick_bad_http, soak_spec
from streamsd.bench.soak_tally import Context, SoakReport, Tally, drain, report_rows
from streamsd.bench.soak_ws import bad_ws, ws_request

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
MAX_CLIENTS = 1024
MAX_DURATION_S = 24 * 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="loopback server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--duration", type=float, required=True, help="seconds of load (then drain)")
    parser.add_argument("--clients", type=int, required=True, help="concurrent client loops")
    parser.add_argument("--disconnect-rate", type=float, default=0.2, help="share of streams cut mid-way")
    parser.add_argument("--bad-input-rate", type=float, default=0.05, help="share of malformed requests")
    parser.add_argument("--websocket-share", type=float, default=0.3, help="share of requests over /v1/ws")
    parser.add_argument("--spec-off-share", type=float, default=0.2,
                        help='share of requests sent with speculative {"enabled": false}')
    parser.add_argument("--max-tokens", type=int, default=32, help="max tokens of each request")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="hard cap on requests sent")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one stream may take")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for /metrics to idle")
    parser.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token, if the server asks for one")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--output-json", default=None, help="write the report as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def check_args(args: argparse.Namespace) -> None:
    """Refuse anything but a bounded run against this machine (it is a stress tool)."""
    parts = urlsplit(args.base_url)
    if parts.scheme not in ("http", "https") or (parts.hostname or "") not in LOOPBACK_HOSTS:
        raise ValueError(f"soak only targets loopback (127.0.0.1, localhost, ::1), not {args.base_url!r}")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise ValueError(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds")
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise ValueError(f"--clients must be in [1, {MAX_CLIENTS}]")
    for name in ("disconnect_rate", "bad_input_rate", "websocket_share", "spec_off_share"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be a probability in [0, 1]")
    if args.max_tokens < 1 or args.max_requests < 1:
        raise ValueError("--max-tokens and --max-requests must be positive")


async def valid_request(ctx: Context, tally: Tally, rng: random.Random, cid: int) -> None:
    index = rng.randrange(len(SOAK_PROMPTS))
    spec = soak_spec(index, ctx.model, ctx.max_tokens, False if rng.random() < ctx.spec_off_share else None)
    cut = rng.random() < ctx.disconnect_rate
    if rng.random() < ctx.websocket_share:
        mode = rng.choice(("close", "cancel")) if cut else None
        await ws_request(ctx, tally, spec, index, f"c{cid}-{tally.started}", mode, rng.randint(1, 3))
        return
    tally.transports["http"] += 1
    result = await stream_sse(ctx.client, ctx.base_url, spec, headers=ctx.headers,
                              disconnect_after=rng.randint(0, 3) if cut else None)
    tally.record(result, ctx.answers[index], spec.speculative)


async def bad_http(ctx: Context, tally: Tally, rng: random.Random) -> None:
    bad = pick_bad_http(rng, ctx.model)
    tally.transports["http"] += 1
    url = ctx.base_url.rstrip("/") + bad.route
    headers = {**ctx.headers, "Content-Type": "application/json"}
    data = bad.body if isinstance(bad.body, bytes) else json.dumps(bad.body).encode()
    try:
        async with ctx.client.post(url, data=data, headers=headers) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.unexpected_error("transport", f"{bad.name}: {exc!r}")
        return
    tally.bad_input_answer(str(resp.status), 400 <= resp.status < 500, bad.name)


async def client_loop(ctx: Context, tally: Tally, cid: int) -> None:
    rng = random.Random(ctx.seed * 100_003 + cid)
    while time.monotonic() < ctx.deadline and tally.started < ctx.max_requests:
        tally.started += 1
        if rng.random() < ctx.bad_input_rate:
            await (bad_ws(ctx, tally, rng, cid) if rng.random() < ctx.websocket_share else bad_http(ctx, tally, rng))
        else:
            await valid_request(ctx, tally, rng, cid)


async def progress(tally: Tally, duration: float, enabled: bool) -> None:
    """A seconds bar with live counts (hidden when stderr is not a terminal)."""
    bar = tqdm(total=round(duration), desc="soak", unit="s", disable=None if enabled else True,
               file=sys.stderr, leave=False)
    start = time.monotonic()
    try:
        while True:
            await asyncio.sleep(1.0)
            bar.n = min(round(time.monotonic() - start), bar.total)
            bar.set_postfix(done=tally.completed, cut=tally.disconnects, lost=tally.lost, garbled=tally.garbled)
    finally:
        bar.close()


async def soak(args: argparse.Namespace) -> SoakReport:
    headers = auth_headers(args.api_key)
    async with session(args.clients + 8, args.request_timeout) as client:
        model = args.model or await first_model(client, args.base_url, headers)
        # Known answers: each prompt alone, non-streaming, before any load.
        answers = [await complete(client, args.base_url, soak_spec(i, model, args.max_tokens), headers)
                   for i in range(len(SOAK_PROMPTS))]
        ctx = Context(
            client=client, base_url=args.base_url, headers=headers, model=model, answers=tuple(answers),
            max_tokens=args.max_tokens, seed=args.seed, deadline=time.monotonic() + args.duration,
            max_requests=args.max_requests, request_timeout=args.request_timeout,
            disconnect_rate=args.disconnect_rate, bad_input_rate=args.bad_input_rate,
            websocket_share=args.websocket_share, spec_off_share=args.spec_off_share,
        )
        tally = Tally()
        start = time.monotonic()
        ticker = asyncio.create_task(progress(tally, args.duration, not args.no_progress))
        await asyncio.gather(*(client_loop(ctx, tally, cid) for cid in range(args.clients)))
        ticker.cancel()
        load_s = time.monotonic() - start
        final = await drain(client, args.base_url, headers, args.drain_timeout)
    return tally.report(args, model, load_s, final)


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as exc:
        print(f"bench soak: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(soak(args))
    except (BenchError, OSError, aiohttp.ClientError) as exc:
        print(f"bench soak: {exc}", file=sys.stderr)
        return 1
    report.print_pairs(f"Soak — {result.model}, {result.clients} clients, {result.duration_s:.0f} s",
                       report_rows(result), result.passed)
    if args.output_json:
        report.write_json(args.output_json, {"version": 1, "soak": dataclasses.asdict(result)})
    return 0 if result.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamsd bench soak", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
