"""`streamsd bench offline`: the engine's speed against the physical floor and HF transformers.

Per batch size: plain greedy decoding (the baseline, and the oracle the synthetic proposer replays),
then the chosen speculative method, then HF transformers `generate` on the same weights (plain at
every batch size; assisted / prompt lookup at batch 1 where it applies). Every request generates
exactly --max-tokens tokens (EOS ignored) so cells compare like with like. Each cell reports TPOT,
tokens/s, acceptance alpha (per draft, given the drafts before it were accepted: accepted / tested,
the alpha of the i.i.d. model; `draft_acceptance` = accepted / drafted is also kept), tau (tokens
per verify step), host time per step (the serial part: scheduling, applying results; the GPU idles),
the draft cost ratio c (one draft step over one target step, timed separately at that batch size), the analytic speedup
(1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)) at the measured alpha and c, spec efficiency = measured
speedup / analytic, and the HBM floor (bytes read per step / 4.25e12 B/s) with our ratio to it.

Besides TPOT, `decode_step_ms` is the median wall time of the steps in which every entry decodes or
verifies (no prompt chunk in it) and `decode_step_floor_ratio` its ratio to the floor step: at a
large batch TPOT also carries the prefill chunks of requests still starting.

With `--speculation-policy adaptive`, each pass gets a fresh policy (offline_cells.Policies).
Each adaptive cell reports the policy's predicted vs measured step time (`pred_err_pct`: mean
|predicted / measured - 1| over the steps it planned and the plain steps between plans that carried
no prompt chunk, with the online correction; `_raw`: the start-up table alone), the share of plain
steps and the histogram of chosen k.

`--forced-plain` adds a `spec k=0` cell per batch size: the speculative engine (its policy and
proposer configured) with every request's k capped at 0, against plain — what speculation costs
when it is never used (the adaptive policy's target: within 1 %).

`--exact` builds the engine in exact mode (EngineConfig.exact), so the same grid run with and without it
prices the batch-invariant forward; `--check-identical` exits 1 unless greedy output is the same at
every batch size and with speculation (bench/identical.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
from typing import Any

import torch

from streamsd.bench import offline_run as R
from streamsd.bench.identical import batch_invariance, report
from streamsd.bench.offline_cells import Policies, forced_plain_cell, hf_cells, make_cell, spec_cell
from streamsd.bench.offline_report import plot, print_table
from streamsd.config import EngineConfig, SpecConfig, SpecMethod
from streamsd.engine.builder import Runtime, build_runtime

TEXT_PROMPTS = (
    "Here is a Python function:\n\ndef moving_average(values, window):\n    result = []\n    for i in "
    "range(len(values) - window + 1):\n        chunk = values[i:i + window]\n        result.append(sum(chunk) "
    "/ window)\n    return result\n\nRewrite it with type hints and a docstring, keeping the same logic.",
    "List the numbers from 1 to 40, one per line, each followed by its square.",
    "Summarize in two sentences: The Eiffel Tower was built for the 1889 World's Fair in Paris. It was "
    "criticised by artists at first but became the symbol of France. It is 330 metres tall.",
    "Write a short story about a robot who learns to paint, in about 150 words.",
    "Explain what a hash table is and how collisions are handled, with a small Python example.",
    "Translate to French: The cat sits on the mat. The dog sleeps by the door. The bird sings in the tree.",
    "Write a JSON object describing three books with title, author and year fields.",
    "What are the main differences between TCP and UDP? Answer as a bulleted list.",
)


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    # A draft model given means draft speculation, as in `serve`.
    method = args.speculative_method or ("draft" if args.draft_model else "none")
    args = argparse.Namespace(**{**vars(args), "speculative_method": method})
    k, max_tokens = args.num_speculative_tokens, args.max_tokens
    if method in ("draft",) and not args.draft_model:
        raise ValueError("--speculative-method draft needs --draft-model")
    alphas = [float(a) for a in str(args.acceptance_rate).split(",") if a.strip()]
    rt, spec = _build(args, batches, k)
    prompts_all = _prompts(rt, max(args.num_prompts or b for b in batches), args.prompt_len)
    dev, dtype = rt.worker.device, rt.worker.target.model.embed_tokens.weight.dtype
    draft_args = _draft_args(rt)
    cells: list[dict[str, Any]] = []
    hf = None if args.no_hf else R.hf_model(rt.model_dir, rt.worker.target, dev, dtype)
    policies = Policies(k) if args.speculation_policy == "adaptive" else None
    first_plain: tuple[int, list[list[int]]] | None = None  # the smallest batch's plain outputs
    for b in sorted(batches):
        prompts = prompts_all[: args.num_prompts or b]
        mean_ctx = sum(map(len, prompts)) / len(prompts) + max_tokens / 2
        floor_plain = R.floor_step_ms(rt.args, dtype, b, mean_ctx)
        R.capture_graphs(rt, b)
        plain_spec = dataclasses.replace(spec, method=None)
        R.engine_pass(rt, plain_spec, prompts, min(8, max_tokens), b, speculative=False)  # warm-up
        plain = R.engine_pass(rt, plain_spec, prompts, max_tokens, b, speculative=False)
        cells.append(make_cell("streamsd", "plain", b, plain, floor_ms=floor_plain, tokens_per_step=1.0))
        cells[-1].update(batch_invariance(plain.outputs, first_plain))
        first_plain = first_plain or (b, plain.outputs)
        if args.unpipelined_plain:
            off = R.unpipelined_pass(rt, plain_spec, prompts, max_tokens, b)
            cells.append(make_cell("streamsd", "plain-unpipelined", b, off, floor_ms=floor_plain, tokens_per_step=1.0))
            cells[-1]["requests_differing_from_plain"] = sum(x != y for x, y in
                                                             zip(plain.outputs, off.outputs, strict=True))
        rerun = functools.partial(R.engine_pass, rt, plain_spec, prompts, max_tokens, b, speculative=False) \
            if args.paired_plain else None
        for alpha in alphas if method == "synthetic" else [None] if method != "none" else []:
            cells.append(spec_cell(rt, spec, args, prompts, b, plain, mean_ctx, dtype, draft_args, policies, alpha,
                                   rerun))
        if method != "none" and args.forced_plain:
            cells.append(forced_plain_cell(rt, spec, args, prompts, b, plain, mean_ctx, floor_plain, policies, rerun))
        if hf is not None:
            cells.extend(hf_cells(rt, hf, args, prompts, b, cells, dev, dtype))
        doc = _doc(args, rt, alphas, cells, policies)
        if args.output_json:  # after every batch size: a run cut short by a time limit keeps its cells
            with open(args.output_json, "w") as f:
                json.dump(doc, f, indent=1)
    doc = _doc(args, rt, alphas, cells, policies)
    print_table(doc)
    if args.plot:
        plot(doc, args.plot)
    return report(cells) if args.check_identical else 0


def _doc(args: argparse.Namespace, rt: Runtime, alphas: list[float], cells: list[dict[str, Any]],
         policies: Policies | None) -> dict[str, Any]:
    dev, dtype = rt.worker.device, rt.worker.target.model.embed_tokens.weight.dtype
    synthetic = args.speculative_method == "synthetic"
    return {
        "command": "streamsd bench offline", "model": args.model, "draft_model": args.draft_model,
        "method": args.speculative_method, "k": args.num_speculative_tokens,
        "speculation_policy": args.speculation_policy, "exact": args.exact, "profile": policies.profile if policies else None,
        "acceptance_rate": (alphas[0] if len(alphas) == 1 else alphas) if synthetic else None,
        "max_tokens": args.max_tokens, "device": _device_name(dev), "dtype": str(dtype).replace("torch.", ""),
        "hbm_bytes_per_s": R.HBM_BYTES_PER_S, "cuda_graphs": rt.worker.graphs is not None,
        "weight_bytes_per_step": R.weight_bytes_read(rt.args, dtype), "cells": cells,
    }


def _build(args: argparse.Namespace, batches: list[int], k: int) -> tuple[Runtime, SpecConfig]:
    method = args.speculative_method
    built: dict[str, SpecMethod] = {"draft": "draft", "ngram": "ngram", "eagle": "eagle"}  # eagle: --draft-model is the head
    build_method = built.get(method)
    if method == "synthetic" and args.draft_model:
        build_method = "draft"  # the synthetic proposer runs the real draft model for its cost
    max_len = max(args.prompt_len, 512) + args.max_tokens + k + 16
    cfg = EngineConfig(
        model=args.model,
        spec=SpecConfig(method=build_method, num_tokens=k, draft_model=args.draft_model),
        device=args.device, dtype=args.dtype, max_num_seqs=max(batches), context_cap=max_len,
        kv_cache_tokens=max(batches) * max_len + 256, max_num_batched_tokens=max(2048, max(batches) * (k + 1)),
        cuda_graphs=not args.no_cuda_graphs, exact=args.exact,
    )
    rt = build_runtime(cfg)
    spec = SpecConfig(method=None if method == "none" else method, num_tokens=k,
                      draft_model=args.draft_model if build_method == "draft" else None)
    return rt, spec


def _prompts(rt: Runtime, n: int, prompt_len: int) -> list[list[int]]:
    """Random ids for random-weight presets; real instructions (chat template when there is one) else."""
    from streamsd.model.presets import is_preset

    if is_preset(rt.model_dir.name):
        gen = random.Random(1234)
        return [[gen.randrange(10, rt.args.vocab_size) for _ in range(prompt_len)] for _ in range(n)]
    tok = rt.tokenizer
    out = []
    for i in range(n):
        text = f"(request {i}) {TEXT_PROMPTS[i % len(TEXT_PROMPTS)]}"
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            out.append(list(tok.encode(text, add_special_tokens=False)))
        else:
            out.append(list(tok.encode(text, add_special_tokens=True)))
    return out


def _draft_args(rt: Runtime):
    draft = rt.worker.proposer.draft_model() if rt.worker.proposer is not None else None
    return draft.model.args if draft is not None else None


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
