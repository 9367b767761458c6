"""The measuring parts of `streamsd bench chat`: one engine per method, one timed answer, the
tallies over the prompts and their rows. No printing."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from streamsd.bench.chat_args import DEFAULT_METHODS
from streamsd.bench.stats import summarize
from streamsd.config import EngineConfig, SpecConfig, TreeShape
from streamsd.engine.builder import build_runtime
from streamsd.engine.core import EngineCore
from streamsd.policy.chooser import TreeChooser
from streamsd.policy.policy import AdaptivePolicy
from streamsd.request import SamplingParams
from streamsd.worker.profile import sync

BASE_METHODS = ("plain", "plain-seq", "ngram", "eagle")

HF = "hf"
KV_CACHE_TOKENS = 8192  # per engine, beyond the longest answer: batch 1 needs one prompt's and answer's


@dataclass(frozen=True, slots=True)
class Answer:
    token_ids: list[int]
    text: str
    seconds: float  # wall time of the request, prefill included
    steps: int  # verify steps (0 for plain decoding)
    emitted: int  # tokens those steps emitted
    queued_taken: int = 0  # steps served by one queued ahead on the device (worker/lookahead.py)
    queued_dropped: int = 0  # queued steps thrown away: each one a wasted step
    kernel_compiles: int = 0  # Triton kernels compiled inside the answer (each a stall); 0 off CUDA


@dataclass(slots=True)
class Tally:
    """One method's answers at one temperature, in prompt order."""

    answers: list[Answer] = field(default_factory=list)

    def row(self, method: str, temperature: float, plain: Tally, exact_mode: bool = False) -> dict[str, Any]:
        """The figures of `method` against plain's at `temperature`. Its answers are counted against
        plain's where they must be equal token for token: greedy speculation, plain-seq (seeded), and in
        the exact mode seeded speculation too."""
        speculative = is_speculative(method)
        exact = method == "plain-seq" or (speculative and (temperature == 0 or exact_mode))
        tokens = sum(len(a.token_ids) for a in self.answers)
        seconds = sum(a.seconds for a in self.answers)
        steps, emitted = sum(a.steps for a in self.answers), sum(a.emitted for a in self.answers)
        per_prompt = summarize(len(a.token_ids) / a.seconds for a in self.answers if a.seconds > 0)
        base = plain.tokens_per_s
        row: dict[str, Any] = {
            "method": method, "temperature": temperature, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1), "vs_plain": round(self.tokens_per_s / base, 3) if base else None,
            "tau": round(emitted / steps, 3) if speculative and steps else None,
            "per_prompt_tokens_per_s": {"median": _r(per_prompt.median), "min": _r(per_prompt.min),
                                        "max": _r(per_prompt.max)},
            "same_as_plain": sum(a.token_ids == p.token_ids for a, p in zip(self.answers, plain.answers, strict=True))
            if exact else None,
        }
        if method != HF:
            row |= {"queued_taken": sum(a.queued_taken for a in self.answers),
                    "queued_dropped": sum(a.queued_dropped for a in self.answers),
                    "kernel_compiles": sum(a.kernel_compiles for a in self.answers)}
        return row | {"answers": [a.text for a in self.answers]}

    @property
    def tokens_per_s(self) -> float:
        seconds = sum(a.seconds for a in self.answers)
        return sum(len(a.token_ids) for a in self.answers) / seconds if seconds > 0 else 0.0


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def is_speculative(method: str) -> bool:
    return method not in ("plain", "plain-seq", HF)


def methods_of(args: argparse.Namespace) -> list[str]:
    """The engines to build, plain first (every row is read against it)."""
    asked = [m.strip() for m in (args.methods or DEFAULT_METHODS).split(",") if m.strip()]
    unknown = [m for m in asked if m not in BASE_METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(BASE_METHODS)} "
                         "(trees come from --trees, the adaptive chain from --adaptive)")
    trees = [f"tree-{t.strip()}" for t in (args.trees or "").split(";") if t.strip()]
    for t in trees:
        TreeShape.parse(t.removeprefix("tree-").removesuffix("/native"))  # a bad shape fails before any load
    chosen = ["plain", *(m for m in BASE_METHODS if m in asked and m != "plain")]
    return [*chosen, *(["eagle-ad"] if args.adaptive else []), *trees]


def build_engine(args: argparse.Namespace, method: str) -> EngineCore:
    """The engine of one method: `tree-D,M,C,N[/native]`, `eagle-ad` (the adaptive policy), `plain-seq`
    (each plain step read before the next is queued), or a plain method name."""
    shape = TreeShape.parse(method.removeprefix("tree-").removesuffix("/native")) if method.startswith("tree-") else None
    kind = "eagle" if shape or method.startswith("eagle") else {"ngram": "ngram"}.get(method)
    spec = SpecConfig(method=kind, num_tokens=shape.nodes if shape else args.k,  # type: ignore[arg-type]
                      draft_model=args.head if kind == "eagle" else None,
                      policy="adaptive" if method == "eagle-ad" else "fixed", tree=shape,
                      int8_draft_head=not method.endswith("/native"))
    cfg = EngineConfig(model=args.model, spec=spec, device=args.device, dtype=args.dtype, max_num_seqs=4,
                       kv_cache_tokens=KV_CACHE_TOKENS + args.max_tokens, cpu_threads=args.threads,
                       pipeline=False if method == "plain-seq" else None, exact=args.exact)
    return EngineCore(build_runtime(cfg), spec)


def answer(core: EngineCore, rid: str, prompt_ids: list[int], params: SamplingParams) -> Answer:
    """One request through `core` alone, timed from submission to its last token."""
    worker = core.rt.worker
    taken, dropped, compiled = worker.lookahead.taken, worker.lookahead.dropped, _compiled(worker.device)
    ids: list[int] = []
    text: list[str] = []
    steps = emitted = 0
    sync(worker.device)
    t0 = time.perf_counter()
    core.add_request(rid, prompt_ids, params)
    for turn in core.run():
        for out in turn.outputs:
            if out.error:
                raise RuntimeError(f"request {rid} failed: {out.error}")
            ids.extend(out.token_ids)
            text.append(out.text)
            if out.finished and out.stats is not None:
                steps, emitted = out.stats.steps, out.stats.emitted
    seconds = time.perf_counter() - t0  # the engine's last step read its tokens: nothing left queued
    return Answer(ids, "".join(text), seconds, steps, emitted, worker.lookahead.taken - taken,
                  worker.lookahead.dropped - dropped, _compiled(worker.device) - compiled)


def hf_answer(model: Any, core: EngineCore, prompt_ids: list[int], params: SamplingParams) -> Answer:
    """The same request through transformers' `generate` (stopping at the same EOS ids)."""
    device = core.rt.worker.device
    ids = torch.tensor([prompt_ids], device=device)  # [1, L]
    sampled = params.temperature > 0
    kw: dict[str, Any] = (dict(do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0) if sampled
                          else dict(do_sample=False))
    if sampled and params.seed is not None:
        torch.manual_seed(params.seed)
    eos = sorted(core.rt.eos_ids)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                             eos_token_id=eos, pad_token_id=eos[0], **kw)
    sync(device)
    seconds = time.perf_counter() - t0
    new = out[0, len(prompt_ids):].tolist()
    return Answer(new, core.tokenizer.decode(new, skip_special_tokens=True), seconds, 0, 0)


def policy_summary(core: EngineCore) -> dict[str, object] | None:
    """What the adaptive policy decided and learnt so far (its counts run on across temperatures)."""
    policy = core.rt.policy
    return policy.summary() if isinstance(policy, AdaptivePolicy | TreeChooser) else None


def _compiled(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    from streamsd.kernels.warmup import compiled_variants

    return compiled_variants()
