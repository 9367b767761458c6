"""`streamsd train-draft`: an EAGLE head for a target by self-distillation, with no dataset.

1. prompts: a user file (JSONL with `turns`, or text lines) and/or user turns the target writes
   itself; a held-out split is kept for the evaluation;
2. the target answers them with our engine (batched); one prefill pass per answer records the
   residual streams the head reads and the final stream whose logits are the soft labels;
3. training-time-test training (streamsd/train/loop.py), AdamW, warm-up + cosine decay;
4. the head is saved in the community's EAGLE-3 (or EAGLE-1) layout, with `training.json` (the
   command, the data, the loss curve) and `eval_report.json`: per-depth acceptance and tau
   (tokens per verify step, bonus included) on the held-out prompts, greedy and at T = 0.7.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamsd.train.data import Collected


# Streams this large swamp what the head's layer adds to fc's raw output (SmolLM2 reaches ~2.5e4 at the
# first position, a few hundred elsewhere; on the same answers, starting the residual from the
# normalised states raised top-1 at step 1 from 0.46 to 0.58).
MASSIVE_STREAM = 1e3


# Defaults by device. CUDA: the recipe of the head shipped for SmolLM2 (thousands of prompts, 512-token
# answers at batch 512, ~20 epochs in 16k-token steps; its README has the run), a few minutes on an H200.
# CPU: a small run that finishes in reasonable time.
DEFAULTS = {
    "cuda": {"num_prompts": 4500, "max_new_tokens": 512, "epochs": 20.0, "lr": 2e-3, "batch_tokens": 16384,
             "gen_batch": 512},
    "cpu": {"num_prompts": 256, "max_new_tokens": 256, "epochs": 2.0, "lr": 1e-3, "batch_tokens": 2048,
            "gen_batch": 64},
}


def _dflt(name: str) -> str:
    return f"; default {DEFAULTS['cuda'][name]:g} on CUDA, {DEFAULTS['cpu'][name]:g} on the CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the target: smollm2-135m-instruct, an HF directory, .gguf or hub id")
    p.add_argument("--out", required=True, help="directory for the head (config.json + model.safetensors)")
    p.add_argument("--prompts", default=None, help="JSONL (first of `turns`, or prompt/question/text) or text lines")
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts (self-written ones fill up)" + _dflt("num_prompts"))
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the evaluation")
    p.add_argument("--eval-prompts-file", default=None,
                   help="the held-out prompts, all of them (JSONL or text as --prompts); those are then never trained on")
    p.add_argument("--no-self-prompts", action="store_true", help="use only the prompts of --prompts")
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest answer" + _dflt("max_new_tokens"))
    p.add_argument("--temperatures", default="0,0.7", help="answers alternate over these temperatures")
    p.add_argument("--epochs", type=float, default=None, help=_dflt("epochs").lstrip("; "))
    p.add_argument("--draft-vocab-size", type=int, default=0, help="0: the target's lm_head over its full vocabulary")
    p.add_argument("--kind", choices=["eagle3", "eagle1"], default="eagle3",
                   help="eagle3: the head reads three of the target's layers; eagle1: its last hidden state")
    p.add_argument("--head-intermediate-size", type=int, default=None, help="default: the target's")
    p.add_argument("--norm-before-residual", choices=["auto", "on", "off"], default="auto", nargs="?", const="on",
                   help="EAGLE-3: the layer's residual starts from the normalised fused states (config flag "
                        "norm_before_residual); auto: on when the target's streams carry values above "
                        f"{MASSIVE_STREAM:g} in magnitude, as SmolLM2's do (~2.5e4); the bare flag: on")
    p.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft steps per training example")
    p.add_argument("--lr", type=float, default=None, help=_dflt("lr").lstrip("; "))
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per optimiser step" + _dflt("batch_tokens"))
    p.add_argument("--time-budget", type=float, default=None, help="minutes of training at most")
    p.add_argument("--gen-time-budget", type=float, default=None,
                   help="minutes of answering at most: then running answers are cut short (and kept)")
    p.add_argument("--gen-batch", type=int, default=None, help="answers generated at once" + _dflt("gen_batch"))
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager CUDA steps (generation and evaluation)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k for the evaluation")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    p.add_argument("--save-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of the saved head's weights")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling and initialisation")
    p.add_argument("--samples-cache", default=None,
                   help="a file: the answers and their streams are saved there, or read from it when it exists "
                        "(other heads trained on the same answers, e.g. to compare settings)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation (validation still runs)")


def apply_defaults(args: argparse.Namespace, cuda: bool) -> None:
    """Fills the settings left unset with the device's defaults (DEFAULTS), so training.json records them."""
    for name, value in DEFAULTS["cuda" if cuda else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args: argparse.Namespace) -> int:
    import torch

    from streamsd import LLM
    from streamsd.engine.builder import pick_device
    from streamsd.spec_decode.eagle.checkpoint import new_head, save_head
    from streamsd.spec_decode.eagle.head import default_aux_layers
    from streamsd.train.data import Collected, draft_vocabulary
    from streamsd.train.eval import evaluate
    from streamsd.train.loop import TrainConfig, train, validate

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.monotonic()

    def log(msg: str) -> None:  # plain lines: they read well in a log file, unlike progress bars
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    out = Path(args.out)
    temps = tuple(float(x) for x in args.temperatures.split(","))
    cuda = pick_device(args.device).type == "cuda"  # where LLM will put the target
    apply_defaults(args, cuda)
    gen_batch = args.gen_batch
    cache = Path(args.samples_cache) if args.samples_cache else None
    reuse = cache is not None and cache.is_file()
    # Reusing saved answers: the engine only lends the target and tokenizer (no batch of graphs to capture).
    # Every answer's prompt is computed in full: its streams are training data (no prefix cache).
    llm = LLM(args.model, device=args.device, max_num_seqs=1 if reuse else gen_batch,
              kv_cache_tokens=args.max_new_tokens + 320 if reuse else gen_batch * (args.max_new_tokens + 320),
              enable_prefix_caching=False, cuda_graphs=not args.no_cuda_graphs)
    target = llm.core.rt.worker.target
    if target.rope_cos.device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the float32 head: its loss is a soft CE
    log(f"target loaded on {target.rope_cos.device}; answers {gen_batch} at a time")
    aux = default_aux_layers(target.args.num_layers) if args.kind == "eagle3" else (target.args.num_layers,)
    if reuse:
        assert cache is not None
        data = Collected.load(cache, target.rope_cos.device)
        why = data.mismatch(tuple(sorted(set(aux))), target.args.hidden_size, target.args.vocab_size)
        if why:
            print(f"error: {cache} does not fit this run: {why}", file=sys.stderr)
            return 2
        log(f"{len(data.samples)} answers ({data.answered} answer tokens) read from {cache}")
    else:
        collected = _collect(args, llm, temps, tuple(sorted(set(aux))), log)
        if collected is None:
            print("error: no training or no held-out prompts; give --prompts or allow self-written ones",
                  file=sys.stderr)
            return 2
        data = collected
        if cache is not None:
            data.save(cache)
            log(f"answers and their streams saved to {cache} (--samples-cache reuses them)")
    samples, held, gen_s, answered = data.samples, data.held, data.generate_s, data.answered
    tokenizer = llm.tokenizer
    del llm  # frees the engine's KV cache and graphs; the target stays for the labels
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    vocab = target.args.vocab_size
    # Every 25th answer is kept out of training: its prompt was never seen, so its figures say how
    # the head drafts for new requests (the training batches' figures also measure memorisation).
    validation = samples[::25] if len(samples) >= 20 else []
    samples = [s for i, s in enumerate(samples) if i % 25 or not validation]
    draft_ids = None
    if args.kind == "eagle3" and 0 < args.draft_vocab_size < vocab:
        special = {t for t in tokenizer.all_special_ids if t < vocab}
        draft_ids = draft_vocabulary(samples, args.draft_vocab_size, vocab, special)
    # One host read for every sample's peak (not one per sample: thousands of syncs on a GPU).
    peak = torch.stack([s.streams.abs().amax() for s in samples if s.streams is not None]).amax().item()
    norm_first = args.kind == "eagle3" and (
        args.norm_before_residual == "on" or (args.norm_before_residual == "auto" and peak > MASSIVE_STREAM))
    if args.kind == "eagle3":
        log(f"largest |value| in the streams the head reads: {peak:.3g}; norm_before_residual: {norm_first}")
    head = new_head(target, kind=args.kind, draft_ids=draft_ids, aux_layers=aux,
                    intermediate_size=args.head_intermediate_size, norm_before_residual=norm_first)
    cfg = TrainConfig(epochs=args.epochs, lr=args.lr, ttt_steps=args.ttt_steps, batch_tokens=args.batch_tokens,
                      time_budget_s=args.time_budget * 60 if args.time_budget else None, seed=args.seed)
    t_train = time.monotonic()
    log(f"training {sum(p.numel() for p in head.parameters())} parameters on "
        f"{sum(len(s.ids) - s.prompt_len for s in samples)} answer tokens")
    history = train(head, target, samples, draft_ids or list(range(vocab)), cfg, log=log, release=True)
    train_s = time.monotonic() - t_train
    log(f"trained {len(history)} steps in {train_s:.0f}s")
    val = validate(head, target, validation, draft_ids or list(range(vocab)), cfg)
    if val:
        log(f"{len(validation)} answers never trained on: top-1 match "
            + " / ".join(f"{val[f'match_{j}']:.2f}" for j in range(cfg.ttt_steps))
            + f", loss at step 1 {val['loss_0']:.3f}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.save_dtype]
    target_cfg = json.loads((Path(_model_dir(args.model)) / "config.json").read_text())
    save_head(head, out, target_cfg, dtype)
    meta = {
        "command": "streamsd " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "args": {k: v for k, v in vars(args).items() if not callable(v)},
        "target": args.model, "kind": args.kind, "aux_layers": list(aux),
        "norm_before_residual": norm_first, "stream_peak": peak,
        "device": str(target.rope_cos.device), "gen_batch": gen_batch,
        "draft_vocab_size": len(draft_ids) if draft_ids else vocab,
        "data": {"prompts_file": args.prompts, "eval_prompts_file": args.eval_prompts_file,
                 "samples_cache": args.samples_cache,
                 "train_prompts": data.train_prompts, "self_written": len(data.written),
                 "held_out_prompts": len(held), "answers": len(samples), "answer_tokens": answered,
                 "tokens": sum(len(s.ids) for s in samples),
                 "temperatures": list(data.temperatures), "max_new_tokens": data.max_new_tokens},
        "train": {"epochs": args.epochs, "steps": len(history), "ttt_steps": args.ttt_steps, "lr": args.lr,
                  "batch_tokens": args.batch_tokens, "first": history[:3], "last": history[-3:],
                  "curve": history[:: max(1, len(history) // 50)]},
        "validation": {"answers": len(validation), **val},
        "seconds": {"write_prompts": round(data.write_s, 1), "generate": round(gen_s, 1),
                    "train": round(train_s, 1)},
        "held_out": held,
        "self_written_prompts": data.written,
    }
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    del target, head, samples
    gc.collect()
    if not args.no_eval:
        log("evaluating on the held-out prompts")
        report = evaluate(args.model, out, held, args.max_new_tokens, args.num_speculative_tokens, args.device,
                          args.seed, cuda_graphs=not args.no_cuda_graphs)
        report["seconds_total"] = round(time.monotonic() - t_start, 1)
        (out / "eval_report.json").write_text(json.dumps(report, indent=2) + "\n")
        for name, r in report["results"].items():
            print(f"{name}: tau {r['tau']:.3f}, acceptance {r['acceptance_rate']:.3f}, "
                  f"per depth {[round(x, 3) for x in r['accept_rate_at_depth']]}")
    size = (out / "model.safetensors").stat().st_size / 2**20
    print(f"head saved to {out} ({size:.1f} MiB{'' if size < 16 else ': OVER the 16 MiB a shipped head may take'})")
    print(f"total {time.monotonic() - t_start:.0f}s (generate {gen_s:.0f}s, train {train_s:.0f}s)")
    return 0


def _collect(args: argparse.Namespace, llm: Any, temps: tuple[float, ...], layers: tuple[int, ...],
             log: Callable[[str], None]) -> Collected | None:
    """Steps 1 and 2: the prompts (given, held out, self-written) and the target's answers with their
    streams, as a `Collected`; None when there is nothing to train or to evaluate on."""
    from streamsd.train.data import Collected, answer
    from streamsd.train.prompts import read_prompts, self_prompts

    rng = random.Random(args.seed)
    given = read_prompts(Path(args.prompts)) if args.prompts else []
    rng.shuffle(given)
    if args.eval_prompts_file:
        held = read_prompts(Path(args.eval_prompts_file))
        seen = set(held)
        train_prompts = [p for p in given if p not in seen][: args.num_prompts]
        wanted = args.num_prompts - len(train_prompts)
    else:
        held, train_prompts = given[: args.eval_prompts], given[args.eval_prompts :][: args.num_prompts]
        wanted = args.num_prompts - len(train_prompts) + (args.eval_prompts - len(held))
    written: list[str] = []
    t_write = time.monotonic()  # --gen-time-budget counts from here: writing prompts and answering them
    if wanted > 0 and not args.no_self_prompts:
        log(f"writing {wanted} prompts with the target itself")
        budget = 60 * args.gen_time_budget / 3 if args.gen_time_budget else None  # a third of it at most
        written = self_prompts(llm, wanted, args.seed, set(given) | set(held),
                               deadline=t_write + budget if budget else None, log=log)
        take = 0 if args.eval_prompts_file else args.eval_prompts - len(held)
        held, train_prompts = held + written[:take], train_prompts + written[take:]
        log(f"{len(written)} prompts written")
    if not train_prompts or not held:
        return None
    t_gen = time.monotonic()
    log(f"answering {len(train_prompts)} prompts (temperatures {temps}, up to {args.max_new_tokens} tokens); "
        f"self-written: {len(written)}")
    deadline = t_write + 60 * args.gen_time_budget if args.gen_time_budget else None
    samples = answer(llm, train_prompts, args.max_new_tokens, args.seed, temps, layers, deadline=deadline, log=log)
    gen_s = time.monotonic() - t_gen
    answered = sum(len(s.ids) - s.prompt_len for s in samples)
    log(f"{answered} answer tokens ({len(samples)} answers) in {gen_s:.0f}s: {answered / max(gen_s, 1e-9):.0f} tokens/s")
    return Collected(samples, layers, held, written, len(train_prompts), t_gen - t_write, gen_s, temps,
                     args.max_new_tokens)


def _model_dir(model: str) -> Path:
    from streamsd.model.loader import resolve_model

    return resolve_model(model)
