"""`streamsd bench offline`: the engine's speed against the physical floor and HF transformers.

Per batch size: plain greedy decoding (the baseline, and the oracle the synthetic proposer replays),
then the chosen speculative method, then HF transformers `generate` on the same weights (plain at
every batch size; assisted / prompt lookup at batch 1 where it applies). Every request generates
exactly --max-tokens tokens (EOS ignored) so cells compare like with like. Each cell reports TPOT,
tokens/s, acceptance alpha (per draft, given the drafts before it were accepted: accepted / tested,
the alpha of the i.i.d. model; `draft_acceptance` = accepted / drafted is also kept), tau (tokens
per verify step), host time per step (scheduling + postprocessing, GPU idle), the draft cost ratio c (one draft step
over one target step, timed separately at that batch size), the analytic speedup
(1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)) at the measured alpha and c, spec efficiency = measured
speedup / analytic, and the HBM floor (bytes read per step / 4.25e12 B/s) with our ratio to it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
from typing import Any

import torch

from streamsd.bench import offline_run as R
from streamsd.bench.offline_report import plot, print_table
from streamsd.config import EngineConfig, SpecConfig
from streamsd.policy import AdaptivePolicy
from streamsd.profiling import profile_costs
from streamsd.runtime import Runtime, build_runtime

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model path, smollm2-135m-instruct, or a random-weight preset: llama-3.1-8b, llama-3.2-1b")
    p.add_argument("--draft-model", default=None, help="draft model (path or preset) for draft/synthetic")
    p.add_argument("--speculative-method", choices=["none", "draft", "ngram", "synthetic"], default="none")
    p.add_argument("--acceptance-rate", type=float, default=0.8, help="alpha of the synthetic proposer")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per cell (default: the batch size)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens for random-weight presets")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--speculation-policy", choices=["fixed", "adaptive"], default="fixed",
                   help="adaptive: k per request and step from a cost table profiled at start")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of the cells")


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    k, method, max_tokens = args.num_speculative_tokens, args.speculative_method, args.max_tokens
    if method in ("draft",) and not args.draft_model:
        raise ValueError("--speculative-method draft needs --draft-model")
    rt, spec = _build(args, batches, k)
    prompts_all = _prompts(rt, max(args.num_prompts or b for b in batches), args.prompt_len)
    dev, dtype = rt.worker.device, rt.worker.target.model.embed_tokens.weight.dtype
    draft_args = _draft_args(rt)
    cells: list[dict[str, Any]] = []
    hf = None if args.no_hf else R.hf_model(rt.model_dir, rt.worker.target, dev, dtype)
    for b in batches:
        prompts = prompts_all[: args.num_prompts or b]
        mean_ctx = sum(map(len, prompts)) / len(prompts) + max_tokens / 2
        floor_plain = R.floor_step_ms(rt.args, dtype, b, mean_ctx)
        R.capture_graphs(rt, b)
        plain_spec = dataclasses.replace(spec, method=None)
        R.engine_pass(rt, plain_spec, prompts, min(8, max_tokens), b, speculative=False)  # warm-up
        plain = R.engine_pass(rt, plain_spec, prompts, max_tokens, b, speculative=False)
        cells.append(_cell("streamsd", "plain", b, plain, floor_ms=floor_plain, tokens_per_step=1.0))
        if method != "none":
            rt_b = _with_policy(rt, args, k)
            cells.append(_spec_cell(rt_b, spec, args, prompts, b, plain, mean_ctx, dtype, draft_args))
            if isinstance(rt_b.policy, AdaptivePolicy):
                cells[-1]["adaptive"] = rt_b.policy.summary()
        if hf is not None:
            cells.extend(_hf_cells(rt, hf, args, prompts, b, cells, dev, dtype))
    doc = {
        "command": "streamsd bench offline", "model": args.model, "draft_model": args.draft_model,
        "method": method, "k": k, "acceptance_rate": args.acceptance_rate if method == "synthetic" else None,
        "max_tokens": max_tokens, "device": _device_name(dev), "dtype": str(dtype).replace("torch.", ""),
        "hbm_bytes_per_s": R.HBM_BYTES_PER_S, "cuda_graphs": rt.worker.graphs is not None,
        "weight_bytes_per_step": R.weight_bytes_read(rt.args, dtype), "cells": cells,
    }
    print_table(doc)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)
    return 0


def _with_policy(rt: Runtime, args: argparse.Namespace, k: int) -> Runtime:
    """A fresh adaptive policy per cell (the profiled cost table is shared), or the runtime as is."""
    if args.speculation_policy != "adaptive":
        return rt
    cost = getattr(args, "_cost", None)
    if cost is None:
        proposer = rt.worker.proposer
        draft = getattr(proposer, "model", None)
        cost = args._cost = profile_costs(rt.worker.target, rt.worker.cache, draft,
                                          getattr(proposer, "cache", None) if draft is not None else None,
                                          rt.scheduler_config.max_num_batched_tokens)
    return dataclasses.replace(rt, policy=AdaptivePolicy(k, copy.deepcopy(cost),
                                               draft_has_cache=getattr(rt.worker.proposer, "keeps_cache", False)))


def _build(args: argparse.Namespace, batches: list[int], k: int) -> tuple[Runtime, SpecConfig]:
    method = args.speculative_method
    build_method = {"draft": "draft", "ngram": "ngram"}.get(method)
    if method == "synthetic" and args.draft_model:
        build_method = "draft"  # the synthetic proposer runs the real draft model for its cost
    max_len = max(args.prompt_len, 512) + args.max_tokens + k + 16
    cfg = EngineConfig(
        model=args.model,
        spec=SpecConfig(method=build_method, num_tokens=k, draft_model=args.draft_model),  # type: ignore[arg-type]
        device=args.device, dtype=args.dtype, max_num_seqs=max(batches), max_model_len=max_len,
        kv_cache_tokens=max(batches) * max_len + 256, max_num_batched_tokens=max(2048, max(batches) * (k + 1)),
        cuda_graphs=not args.no_cuda_graphs,
    )
    rt = build_runtime(cfg)
    spec = SpecConfig(method=None if method == "none" else method, num_tokens=k,  # type: ignore[arg-type]
                      draft_model=args.draft_model if build_method == "draft" else None,
                      synthetic_acceptance=args.acceptance_rate)
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
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
            out.append(list(tok.encode(text, add_special_tokens=False)))
        else:
            out.append(list(tok.encode(text, add_special_tokens=True)))
    return out


def _draft_args(rt: Runtime):
    proposer = rt.worker.proposer
    model = getattr(proposer, "model", None)
    return model.args if model is not None and hasattr(model, "args") else None


def _spec_cell(rt: Runtime, spec: SpecConfig, args: argparse.Namespace, prompts: list[list[int]], b: int,
               plain: R.PassResult, mean_ctx: float, dtype: torch.dtype, draft_args) -> dict[str, Any]:
    from streamsd.spec.synthetic import SyntheticProposer

    k, method = spec.num_tokens, args.speculative_method
    desyncs = warm_desyncs = plain_vs_spec = None
    if method == "synthetic":
        inner = rt.worker.proposer
        inner = getattr(inner, "inner", inner)
        prop = SyntheticProposer({tuple(p): o for p, o in zip(prompts, plain.outputs, strict=True)},
                                 args.acceptance_rate, rt.args.vocab_size, inner)
        rt.worker.proposer = prop
        warm = R.engine_pass(rt, spec, prompts, args.max_tokens, b, speculative=True)  # re-records the oracle
        warm_desyncs = prop.counters.desyncs
        prop.reset({tuple(p): o for p, o in zip(prompts, warm.outputs, strict=True)})
    else:
        R.engine_pass(rt, spec, prompts, min(8, args.max_tokens), b, speculative=True)  # warm-up
    res = R.engine_pass(rt, spec, prompts, args.max_tokens, b, speculative=True)
    if method == "synthetic":
        desyncs = rt.worker.proposer.counters.desyncs
        plain_vs_spec = sum(a != b for a, b in zip(plain.outputs, warm.outputs, strict=True))
    c = R.draft_cost_ratio(rt, b)
    floor = R.floor_step_ms(rt.args, dtype, b, mean_ctx, draft_args if c else None, k)
    cell = _cell("streamsd", method, b, res, floor_ms=floor, tokens_per_step=res.tau or 1.0)
    analytic = R.analytic_speedup(res.alpha, k, c)
    measured = plain.tpot_ms / res.tpot_ms if res.tpot_ms else 0.0
    cell.update(k=k, c=round(c, 4), analytic_speedup=round(analytic, 3), measured_speedup=round(measured, 3),
                spec_efficiency=round(measured / analytic, 3) if analytic else None, desyncs=desyncs,
                same_output_as_plain=res.outputs == plain.outputs)
    if method == "synthetic":  # how far the verify-shaped numerics strayed from plain decoding
        cell.update(warm_desyncs=warm_desyncs, requests_differing_from_plain=plain_vs_spec)
    return cell


def _hf_cells(rt: Runtime, hf: Any, args: argparse.Namespace, prompts: list[list[int]], b: int,
              cells: list[dict[str, Any]], dev: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    pad = rt.tokenizer.pad_token_id if rt.tokenizer.pad_token_id is not None else 0
    out = []
    tpot, tps = R.hf_pass(hf, prompts, args.max_tokens, dev, pad)
    out.append({"engine": "hf", "method": "plain", "batch": b, "tpot_ms": round(tpot, 3), "tokens_per_s": round(tps, 1)})
    ours = next(c for c in cells if c["engine"] == "streamsd" and c["method"] == "plain" and c["batch"] == b)
    ours["hf_tpot_ms"], ours["x_hf_tokens_per_s"] = round(tpot, 3), round(ours["tokens_per_s"] / tps, 2)
    if b == 1 and args.speculative_method in ("ngram", "draft"):
        kw: dict[str, Any] = {"prompt_lookup_num_tokens": args.num_speculative_tokens}
        name = "prompt-lookup"
        if args.speculative_method == "draft":
            name = "assisted"
            draft = R.hf_model(_draft_dir(args.draft_model), rt.worker.proposer.model, dev, dtype)
            kw = {"assistant_model": draft, "num_assistant_tokens": args.num_speculative_tokens,
                  "num_assistant_tokens_schedule": "constant"}
        tpot, tps = R.hf_pass(hf, prompts, args.max_tokens, dev, pad, **kw)
        out.append({"engine": "hf", "method": name, "batch": b, "tpot_ms": round(tpot, 3),
                    "tokens_per_s": round(tps, 1)})
    return out


def _draft_dir(spec: str):
    from streamsd.model.loader import resolve_model
    from streamsd.model.presets import is_preset, preset_dir

    return preset_dir(spec) if is_preset(spec) else resolve_model(spec)


def _cell(engine: str, method: str, b: int, r: R.PassResult, *, floor_ms: float, tokens_per_step: float) -> dict:
    floor_tpot = floor_ms / max(tokens_per_step, 1e-9)
    return {
        "engine": engine, "method": method, "batch": b, "tpot_ms": round(r.tpot_ms, 3),
        "tokens_per_s": round(r.tokens_per_s, 1), "ttft_ms": round(r.ttft_ms, 2), "tokens": r.tokens,
        "steps": r.steps, "acceptance": round(r.alpha, 4), "draft_acceptance": round(r.acceptance, 4),
        "tau": round(r.tau, 3),
        "host_ms_per_step": round(r.host_ms, 3), "execute_ms_per_step": round(r.execute_ms, 3),
        "floor_step_ms": round(floor_ms, 3), "floor_tpot_ms": round(floor_tpot, 3),
        "floor_ratio": round(r.tpot_ms / floor_tpot, 3) if floor_tpot else None,
    }


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
