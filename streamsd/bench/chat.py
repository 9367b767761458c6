"""`streamsd bench chat`: batch-1 decode speed on real chat answers, one engine per method.

`streamsd bench offline` times fixed-length greedy runs; this times answers as a user gets them
(stopping at EOS) at several temperatures, on prompts the draft head never saw: by default the
held-out prompts of the head's training.json (`streamsd train-draft` writes it), else --dataset.

Methods: plain; plain-seq (plain with each step read before the next is queued: what queueing a step
ahead gains); ngram; eagle (a chain of --k drafts, the fixed policy); eagle-ad (--adaptive: the chain
under the adaptive policy, what `streamsd serve` runs for chains); tree-D,M,C,N (--trees); and hf,
transformers' `generate` on the same weights. Methods take turns per prompt so a noisy machine
slows them alike; every engine first answers a warm-up prompt per temperature (CUDA graphs are
captured and Triton kernels compiled there, not in a timing). tokens/s = generated tokens / wall
time of the requests (prefill included), summed over the prompts; τ = tokens per verify step.

Every row carries its answers. At T=0 `same_as_plain` counts the speculative answers that equal
plain's token for token (speculation is lossless; in bfloat16 a verify's wider passes can round
differently from plain's one-row step: --dtype float32 takes that out). Sampled answers are
seeded per prompt, so plain-seq matches plain at every temperature; with --exact (every engine in
the exact mode) so does every speculative method.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from streamsd.bench.chat_run import (
    HF,
    Tally,
    answer,
    build_engine,
    hf_answer,
    methods_of,
    policy_summary,
)
from streamsd.bench.datasets import load_dataset
from streamsd.bench.offline_run import hf_model
from streamsd.bench.report import print_grid, write_json
from streamsd.engine.core import EngineCore
from streamsd.model.loader import ModelLoadError
from streamsd.request import SamplingParams
from streamsd.spec_decode.eagle.checkpoint import head_dir

WARM_UP = [{"role": "user", "content": "Say hello in three languages."}]


def run(args: argparse.Namespace) -> int:
    temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
    if not temperatures or args.prompts < 1 or args.max_tokens < 1:
        raise ValueError("--temperatures, --prompts and --max-tokens need at least one each")
    methods = methods_of(args)
    prompts, source = load_prompts(args)
    engines = {m: build_engine(args, m) for m in methods}
    plain = engines["plain"]
    worker = plain.rt.worker
    dtype = worker.target.model.embed_tokens.weight.dtype
    hf = None if args.no_hf else hf_model(plain.rt.model_dir, worker.target, worker.device, dtype)
    convs = [plain.text.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    warm = plain.text.encode_chat(WARM_UP)
    for t in temperatures:
        params = SamplingParams(temperature=t, max_tokens=32, seed=0)
        for m, core in engines.items():
            answer(core, f"warm-{m}-{t:g}", warm, params)
        if hf is not None:
            hf_answer(hf, plain, warm, params)
    rows: list[dict[str, Any]] = []
    policies: dict[str, Any] = {}
    doc: dict[str, Any] = {}
    for t in temperatures:
        tallies = {m: Tally() for m in [*engines, *([HF] if hf is not None else [])]}
        for i, ids in enumerate(convs):
            params = SamplingParams(temperature=t, max_tokens=args.max_tokens, seed=i)
            for m, core in engines.items():
                tallies[m].answers.append(answer(core, f"{m}-{t:g}-{i}", ids, params))
            if hf is not None:
                tallies[HF].answers.append(hf_answer(hf, plain, ids, params))
        rows += [tally.row(m, t, tallies["plain"], args.exact) for m, tally in tallies.items()]
        policies |= {f"{m} T={t:g}": s for m, core in engines.items() if (s := policy_summary(core)) is not None}
        doc = _doc(args, plain, source, len(prompts), rows, policies)
        if args.output_json:  # after every temperature: a run cut short keeps its figures
            write_json(args.output_json, doc)
    print_table(doc)
    return 0


def load_prompts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The prompts and where they came from: --dataset, else a training.json's held-out prompts."""
    if args.dataset:
        return [p.text for p in load_dataset(args.dataset, args.prompts)], args.dataset
    try:
        path = Path(args.held_out) if args.held_out else head_dir(args.head, args.model) / "training.json"
    except ModelLoadError as exc:
        raise ValueError(f"no held-out prompts ({exc}); give --head, --held-out or --dataset") from exc
    if not path.is_file():
        raise ValueError(f"no held-out prompts: {path} does not exist; give --held-out or --dataset")
    held_out = json.loads(path.read_text(encoding="utf-8")).get("held_out")
    if not held_out:
        raise ValueError(f"{path} lists no held_out prompts; give --dataset")
    return [str(p) for p in held_out[: args.prompts]], str(path)


def _doc(args: argparse.Namespace, plain: EngineCore, source: str, prompts: int, rows: list[dict[str, Any]],
         policies: dict[str, Any]) -> dict[str, Any]:
    worker = plain.rt.worker
    dev = worker.device
    return {
        "command": "streamsd bench chat", "model": args.model, "head": args.head, "prompts_from": source,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(worker.target.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "cuda_graphs": worker.graphs is not None, "exact": args.exact, "k": args.k, "prompts": prompts,
        "max_tokens": args.max_tokens,
        "rows": rows, "policy": policies,
    }


def print_table(doc: dict[str, Any]) -> None:
    mode = ", exact mode" if doc.get("exact") else ""
    title = (f"streamsd bench chat — {Path(doc['model']).name} on {doc['device']} ({doc['dtype']}{mode}), batch 1, "
             f"{doc['prompts']} prompts, up to {doc['max_tokens']} tokens, k={doc['k']}")
    caption = (f"prompts from {doc['prompts_from']}; tok/s: generated tokens / wall time (prefill included); "
               "τ: tokens per verify step; = plain: answers identical to plain's (T=0, plain-seq; every T exact)")
    headers = ("method", "T", "tokens", "tok/s", "× plain", "τ", "= plain")
    print_grid(title, headers, [
        (r["method"], f"{r['temperature']:g}", str(r["tokens"]), f"{r['tokens_per_s']:.1f}",
         "-" if r["vs_plain"] is None else f"{r['vs_plain']:.2f}×", "-" if r["tau"] is None else f"{r['tau']:.2f}",
         "-" if r["same_as_plain"] is None else f"{r['same_as_plain']}/{doc['prompts']}")
        for r in doc["rows"]], caption)
