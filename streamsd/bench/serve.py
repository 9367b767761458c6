"""`streamsd bench serve`: load an OpenAI-compatible server with streamed requests and report
latency (TTFT, TPOT, ITL, e2e), throughput, errors and speculation figures, like `vllm bench serve`.

Works against any OpenAI-compatible server; the per-request `speculative` switch
(`--compare-speculation`) and the `streamsd:` metrics are streamsd extensions (vLLM's `vllm:`
speculation counters are read as well).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from tqdm import tqdm

from streamsd.bench import report
from streamsd.bench.client import (
    BenchError,
    RequestResult,
    RequestSpec,
    auth_headers,
    first_model,
    session,
    stream_sse,
)
from streamsd.bench.compare import compare
from streamsd.bench.datasets import BenchPrompt, load_dataset, shared_prefix
from streamsd.bench.metrics_scrape import scrape, spec_delta
from streamsd.bench.results import CellPlan, CellResult, build_cell, run_document

Num = TypeVar("Num", int, float)

DEFAULT_MAX_TOKENS = 128
FOLLOW_UP = "Please go on."  # --multi-turn's second turn where the dataset has none (random, ShareGPT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions or /v1/completions")
    parser.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token, if the server asks for one")
    parser.add_argument(
        "--dataset", default="random",
        help="MT-bench JSONL (`turns`), ShareGPT JSON (`conversations`), `random` or `random:<words>`",
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests per cell")
    parser.add_argument("--random-input-len", type=int, default=128, help="words per random prompt")
    parser.add_argument("--random-output-len", type=int, default=128, help="max tokens of random prompts")
    parser.add_argument(
        "--request-rate", type=float, default=math.inf,
        help="Poisson arrival rate in requests/s (default inf: all at once, bounded by concurrency)",
    )
    parser.add_argument(
        "--sweep-request-rate", default=None,
        help="comma list of requests/s, e.g. 5,10,20: one cell per Poisson arrival rate (instead of --request-rate)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument(
        "--sweep-concurrency", default=None, help="comma list, e.g. 1,2,4,8: one cell per concurrency"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: dataset's, else 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max tokens (server extension)")
    parser.add_argument(
        "--response-format", default=None,
        help="structured output for every request: `json_object`, or a JSON schema's file (the grammar's cost)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset, arrivals and per-request sampling seeds")
    parser.add_argument(
        "--compare-speculation", action="store_true",
        help='run every cell with speculative {"enabled": false} and {"enabled": true}',
    )
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="rounds per setting, in ABBA order with --compare-speculation; the rounds' plain cells "
             "against each other measure the run's noise (bench/compare.py)",
    )
    parser.add_argument(
        "--num-warmups", type=int, default=0, metavar="N",
        help="run the first cell's requests N times, unmeasured, before the measured cells: a server's first "
             "batch pays one-off costs (its prompts' first prefill, a cold prefix cache) that would otherwise "
             "land in whichever setting runs first",
    )
    parser.add_argument(
        "--multi-turn", action="store_true",
        help="chat only: every request is a conversation of two turns, the second (MT-bench's, else "
             f"{FOLLOW_UP!r}) sent with the first's answer as soon as it is back; each turn gets its cells, "
             "the second's TTFT shows what a prefix cache saves",
    )
    parser.add_argument(
        "--shared-prefix-tokens", type=int, default=0, metavar="N",
        help="start every request with the same system prompt of about N tokens (chat: a system message; "
             "completions: a text prefix), drawn from --seed: TTFT then shows what the prefix cache saves",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a stream may stall")
    parser.add_argument("--output-json", default=None, help="write every figure here")
    parser.add_argument("--plot", default=None, help="write a PNG: latency CDFs, sweep curves")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _positives(text: str, convert: Callable[[str], Num], flag: str, what: str) -> list[Num]:
    """The comma list `text` of `flag`: each value positive and finite, else a ValueError that names it."""
    try:
        values = [convert(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        values = []
    if not values or any(not 0 < v < math.inf for v in values):
        raise ValueError(f"{flag} needs {what}, got {text!r}")
    return values


def parse_sweep(text: str) -> list[int]:
    return _positives(text, int, "--sweep-concurrency", "positive integers")


def parse_rates(text: str) -> list[float]:
    return _positives(text, float, "--sweep-request-rate", "positive, finite requests/s")


def plan_cells(args: argparse.Namespace) -> list[CellPlan]:
    """Cells in run order; with --compare-speculation off and on run back to back for each setting
    so slow drift (thermal, other load) hits both alike, and with --repeats the order alternates
    from round to round (off, on | on, off | ...) so that it favours neither."""
    if args.sweep_concurrency and args.max_concurrency is not None:
        raise ValueError("--sweep-concurrency and --max-concurrency are alternatives")
    if args.sweep_request_rate and math.isfinite(args.request_rate):
        raise ValueError("--sweep-request-rate and --request-rate are alternatives")
    if args.repeats < 1:
        raise ValueError(f"--repeats needs a positive integer, got {args.repeats}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups needs a count >= 0, got {args.num_warmups}")
    if args.multi_turn and args.endpoint != "chat":
        raise ValueError("--multi-turn sends conversations: it needs --endpoint chat")
    if args.shared_prefix_tokens < 0:
        raise ValueError(f"--shared-prefix-tokens needs a count >= 0, got {args.shared_prefix_tokens}")
    prefix = args.shared_prefix_tokens or None
    concurrencies = parse_sweep(args.sweep_concurrency) if args.sweep_concurrency else [args.max_concurrency]
    rates = parse_rates(args.sweep_request_rate) if args.sweep_request_rate else [args.request_rate]
    switches: list[bool | None] = [False, True] if args.compare_speculation else [None]
    numbered = args.repeats > 1
    return [CellPlan(c, rate, s, r if numbered else None, shared_prefix_tokens=prefix)
            for c in concurrencies for rate in rates for r in range(args.repeats)
            for s in (switches if r % 2 == 0 else switches[::-1])]


def response_format(arg: str | None) -> dict[str, Any] | None:
    """--response-format as the request field: JSON mode, or the schema read from a file."""
    if arg is None:
        return None
    if arg == "json_object":
        return {"type": "json_object"}
    schema = json.loads(Path(arg).read_text(encoding="utf-8"))
    return {"type": "json_schema", "json_schema": {"name": Path(arg).stem, "schema": schema}}


def request_specs(args: argparse.Namespace, model: str, prompts: Sequence[BenchPrompt], spec: bool | None) -> list[RequestSpec]:
    system = shared_prefix(args.shared_prefix_tokens, args.seed) if args.shared_prefix_tokens else None
    structured = response_format(args.response_format)
    return [
        RequestSpec(
            endpoint=args.endpoint,
            model=model,
            text=p.text,
            max_tokens=args.max_tokens or p.output_len or DEFAULT_MAX_TOKENS,
            temperature=args.temperature,
            seed=args.seed + i,
            ignore_eos=args.ignore_eos,
            speculative=spec,
            system=system,
            response_format=structured,
        )
        for i, p in enumerate(prompts)
    ]


async def run_cell(
    client: aiohttp.ClientSession,
    base_url: str,
    headers: dict[str, str],
    specs: Sequence[RequestSpec],
    plan: CellPlan,
    *,
    seed: int,
    progress: bool,
    follow_ups: Sequence[str] | None = None,
) -> tuple[list[RequestResult], float, list[RequestResult]]:
    """Send every request of one cell; returns the results (in request order), the wall time and, with
    `follow_ups`, the second turns' results: each sent, with its first turn's answer, once that is back
    (a conversation holds its concurrency slot for both turns)."""
    gate = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    arrivals = random.Random(seed)
    bar = tqdm(total=len(specs), desc=plan.label, disable=None if progress else True, file=sys.stderr, leave=False)
    seconds: list[RequestResult | None] = [None] * len(specs)

    async def turns(i: int, spec: RequestSpec) -> RequestResult:
        result = await stream_sse(client, base_url, spec, headers=headers)
        if follow_ups is not None and result.ok:
            nxt = replace(spec, text=follow_ups[i], history=(*spec.history, (spec.text, result.text)))
            seconds[i] = await stream_sse(client, base_url, nxt, headers=headers)
        return result

    async def one(i: int, spec: RequestSpec) -> RequestResult:
        if gate is None:
            result = await turns(i, spec)
        else:
            async with gate:
                result = await turns(i, spec)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for i, spec in enumerate(specs):
        tasks.append(asyncio.create_task(one(i, spec)))
        if math.isfinite(plan.request_rate):
            await asyncio.sleep(arrivals.expovariate(plan.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration, [r for r in seconds if r is not None]


async def probe(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str], spec: RequestSpec) -> None:
    """One short request before measuring, so a wrong URL, model or endpoint fails fast and clearly.
    It leaves out a shared prefix: the first measured request is the one that prefills it."""
    short = RequestSpec(spec.endpoint, spec.model, spec.text, 2, spec.temperature, spec.seed, False, spec.speculative)
    result = await stream_sse(client, base_url, short, headers=headers)
    if not result.ok:
        raise BenchError(f"probe request failed ({result.error_kind}): {result.message}")


async def benchmark(args: argparse.Namespace) -> tuple[dict, list[CellResult]]:
    plans = plan_cells(args)
    headers = auth_headers(args.api_key)
    top = max((p.concurrency or args.num_prompts) for p in plans)
    async with session(top + 4, args.timeout) as client:
        model = args.model or await first_model(client, args.base_url, headers)
        prompts = load_dataset(
            args.dataset, args.num_prompts, seed=args.seed,
            random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        )
        await probe(client, args.base_url, headers, request_specs(args, model, prompts[:1], plans[-1].speculative)[0])
        follow_ups = [p.follow_up or FOLLOW_UP for p in prompts] if args.multi_turn else None
        for w in range(args.num_warmups):
            _, duration, _ = await run_cell(client, args.base_url, headers,
                                            request_specs(args, model, prompts, plans[0].speculative), plans[0],
                                            seed=args.seed - 1 - w, progress=False, follow_ups=follow_ups)
            print(f"warm-up {w + 1}: {len(prompts)} requests in {duration:.1f} s (not measured)", file=sys.stderr)
        cells = []
        for i, plan in enumerate(plans):
            before = await scrape(client, args.base_url, headers)
            specs = request_specs(args, model, prompts, plan.speculative)
            results, duration, seconds = await run_cell(
                client, args.base_url, headers, specs, plan, seed=args.seed + i, progress=not args.no_progress,
                follow_ups=follow_ups,
            )
            after = await scrape(client, args.base_url, headers)
            if follow_ups is not None:  # the server's counters cover both turns: the second turn's cell has them
                cells.append(build_cell(replace(plan, turn=1), results, duration, None))
                plan = replace(plan, turn=2)
                results = seconds
            cells.append(build_cell(plan, results, duration, spec_delta(before, after)))
            done = cells[-1].requests
            print(f"{plan.label}: {done.completed} ok, {done.failed} failed in {duration:.1f} s", file=sys.stderr)
    config = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else None,
        "max_concurrency": args.max_concurrency, "sweep_concurrency": args.sweep_concurrency,
        "sweep_request_rate": args.sweep_request_rate,
        "compare_speculation": args.compare_speculation, "multi_turn": args.multi_turn,
        "shared_prefix_tokens": args.shared_prefix_tokens or None, "repeats": args.repeats,
        "num_warmups": args.num_warmups, "ignore_eos": args.ignore_eos, "seed": args.seed,
        "response_format": args.response_format,
    }
    return config, cells


def run(args: argparse.Namespace) -> int:
    try:
        config, cells = asyncio.run(benchmark(args))
    except (BenchError, ValueError, OSError, aiohttp.ClientError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 1
    report.print_serve(config, cells)
    comparisons = compare(cells) if args.compare_speculation else []
    if comparisons:
        report.print_comparisons(comparisons)
    if args.output_json:
        report.write_json(args.output_json, run_document(config, cells, comparisons))
    if args.plot:
        report.plot_serve(args.plot, cells)
    return 0 if all(c.requests.completed for c in cells) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamsd bench serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
