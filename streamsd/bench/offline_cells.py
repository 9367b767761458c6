"""One cell of `streamsd bench offline`: a speculative pass against its plain baseline (with the
synthetic proposer's warm-up and the adaptive policy's carried cost corrections), HF transformers'
cells, and the row dictionary every cell becomes."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsd.bench import offline_run as R
from streamsd.bench.compare import spread_of, verdict
from streamsd.bench.identical import identical
from streamsd.config import SpecConfig
from streamsd.engine.builder import Runtime, adaptive_policy, queue_chains
from streamsd.policy.adaptive import CostTable
from streamsd.policy.policy import AdaptivePolicy
from streamsd.spec_decode.draft_model import DraftModelProposer
from streamsd.worker.profile import profile_worker

PlainRerun = Callable[[], R.PassResult]
WARM_PASSES = 3  # at most: synthetic warm-up passes that record oracle branches

HF_BATCH_ONE = "n/a: HF assisted generation supports batch 1 only"


@dataclass(slots=True)
class Policies:
    """The adaptive policy of each pass. Each pass gets a new one that keeps what the passes before
    it learnt, as a running server's policy does across waves of requests: the cost table, profiled
    once (at the first cell's context) with the online corrections of every pass since (step costs
    are the machine's), and in the measured passes the proposer's running acceptance prior from the
    cell's last warm-up pass on (a cell is one proposer at one alpha; its warm-up passes start from
    the configured default). Per-request estimates and the planner's state are new. Until session
    11 every measured pass started from the default prior: each 64-token pass paid a new server's
    cold start (entering at the 0.6 default, and the way back at alpha 0.3: 2-4 % at B = 64)."""

    k: int
    cost: CostTable | None = None
    profile: dict[str, Any] | None = None  # how the table was made, for the JSON

    def fresh(self, rt: Runtime, context: int, learned: Runtime | None = None, acceptance: bool = False) -> Runtime:
        """`rt` with a new policy, its table (and with `acceptance` its acceptance prior) from
        `learned`'s if given."""
        priors = None
        if learned is not None and isinstance(learned.policy, AdaptivePolicy):
            self.cost = learned.policy.cost
            priors = learned.policy.estimator.priors if acceptance else None
        if self.cost is None:
            t0 = time.perf_counter()  # profile_costs captures the graphs it times outside its budget
            self.cost = profile_worker(rt.worker, rt.scheduler_config.max_num_seqs,
                                       rt.scheduler_config.max_num_batched_tokens, self.k, context=context)
            shape = self.cost.shape
            self.profile = {
                "seconds": round(time.perf_counter() - t0, 3), "context": context,
                "graphs": rt.worker.graphs is not None,
                "widths": list(shape.widths) if shape else [],
                "step_ms": {str(b): [round(t * 1e3, 4) for t in row]
                            for b, row in zip(shape.batches, shape.values, strict=True)} if shape else {},
                "cells_timed": shape.timed if shape else 0,
            }
        policy = adaptive_policy(self.k, copy.deepcopy(self.cost), rt.worker)
        if priors is not None:
            policy.estimator.priors = copy.deepcopy(priors)
        return dataclasses.replace(rt, policy=policy)


def _with_policy(rt: Runtime, policies: Policies | None, mean_ctx: float, learned: Runtime | None = None,
                 acceptance: bool = False) -> Runtime:
    """`rt` under a fresh adaptive policy (see Policies), or as it is for a fixed k."""
    return rt if policies is None else policies.fresh(rt, round(mean_ctx), learned, acceptance)


def spec_cell(rt: Runtime, spec: SpecConfig, args: argparse.Namespace, prompts: list[list[int]], b: int,
              plain: R.PassResult, mean_ctx: float, dtype: torch.dtype, draft_args, policies: Policies | None,
              alpha: float | None = None, rerun_plain: PlainRerun | None = None) -> dict[str, Any]:
    """One speculative cell; ``policies``: adaptive k (None: fixed); ``alpha``: the synthetic
    proposer's acceptance (synthetic only); ``rerun_plain``: compare against a plain pass run just
    before the measured one (see `_against_plain`)."""
    from streamsd.spec_decode.synthetic import SyntheticProposer

    k, method = spec.num_tokens, args.speculative_method
    desyncs = plain_vs_spec = None
    warm_desyncs: list[int] = []
    if method == "synthetic":
        assert alpha is not None
        inner = rt.worker.proposer
        if isinstance(inner, SyntheticProposer):  # an earlier cell's
            inner = inner.inner
        prop = SyntheticProposer({tuple(p): o for p, o in zip(prompts, plain.outputs, strict=True)},
                                 alpha, rt.args.vocab_size, inner)
        rt.worker.use_proposer(prop)
        if inner is None and rt.worker.lookahead.enabled:
            # Drafts made on the device (SyntheticProposer.chain): its steps queue ahead like an EAGLE
            # head's, with the KV margin a queued verify writes into.
            rt = dataclasses.replace(rt, scheduler_config=queue_chains(rt.worker, rt.scheduler_config, k))
        # Warm-up passes also record the spec-shaped continuations as branches of the oracle (see
        # spec_decode/synthetic.py); a second one only when the first left the oracle somewhere.
        rt_w: Runtime | None = None
        for _ in range(WARM_PASSES):
            rt_w = _with_policy(rt, policies, mean_ctx, rt_w)
            warm = R.engine_pass(rt_w, spec, prompts, args.max_tokens, b, speculative=True)
            warm_desyncs.append(prop.counters.desyncs)
            if plain_vs_spec is None:
                plain_vs_spec = sum(x != y for x, y in zip(plain.outputs, warm.outputs, strict=True))
            prop.add({tuple(p): o for p, o in zip(prompts, warm.outputs, strict=True)})
            if not warm_desyncs[-1]:
                break
    else:
        rt_w = _with_policy(rt, policies, mean_ctx)
        R.engine_pass(rt_w, spec, prompts, min(8, args.max_tokens), b, speculative=True)
    # A warm-up pass whose history left the oracle (a desync) saw corrupted drafts only there: its
    # acceptance is not the cell's, and the measured passes start from the default prior instead.
    clean = not warm_desyncs or warm_desyncs[-1] == 0

    def measure() -> tuple[R.PassResult, Runtime]:
        nonlocal rt_w  # each pass's policy starts from what the passes before it learnt (Policies)
        rt_w = _with_policy(rt, policies, mean_ctx, rt_w, acceptance=clean)
        return R.engine_pass(rt_w, spec, prompts, args.max_tokens, b, speculative=True), rt_w

    passes = _paired_passes(args.pairs, rerun_plain, measure)
    res, paired, rt_m = _median_pair(passes, plain)
    if method == "synthetic":
        desyncs = prop.counters.desyncs
    c = R.draft_cost_ratio(rt, b)
    floor = R.floor_step_ms(rt.args, dtype, b, mean_ctx, draft_args if c else None, k)
    cell = make_cell("streamsd", method, b, res, floor_ms=floor, tokens_per_step=res.tau or 1.0)
    analytic = R.analytic_speedup(res.alpha or 0.0, k, c)
    cell.update(_against_plain(res, plain, paired))
    cell.update(_pair_spread(passes, plain, cell["measured_speedup"]))
    measured = cell["measured_speedup"]
    cell.update(k=k, c=round(c, 4), analytic_speedup=round(analytic, 3),
                spec_efficiency=round(measured / analytic, 3) if analytic else None, desyncs=desyncs)
    if method == "synthetic":  # how far the verify-shaped numerics strayed from plain decoding
        cell.update(acceptance_rate=alpha, warm_desyncs=warm_desyncs[0], warm_desyncs_per_pass=warm_desyncs,
                    requests_differing_from_plain=plain_vs_spec)
    if isinstance(rt_m.policy, AdaptivePolicy):
        summary = rt_m.policy.summary()
        cell["adaptive"] = summary
        err = summary["mean_abs_prediction_error"]
        cell["pred_err_pct"] = round(100 * err, 2) if isinstance(err, float) else None
        kinds = summary["prediction_error"]
        assert isinstance(kinds, dict)
        raw = [(e["mean_abs_raw"], e["steps"]) for e in kinds.values()]
        n = sum(s for _, s in raw)
        cell["pred_err_raw_pct"] = round(100 * sum(e * s for e, s in raw) / n, 2) if n else None
        share = summary["plain_step_share"]
        assert isinstance(share, float)  # a ratio (policy/record.py)
        cell["plain_step_share"] = round(share, 3)
        # The table per (batch, verify tokens) shape: the worst |Σ predicted / Σ measured − 1| over the
        # shapes the cell ran at least 10 times (the per-step mean above also counts each step's jitter).
        shapes = summary["by_shape"]
        assert isinstance(shapes, dict)
        common = [abs(v["ratio"] - 1.0) for v in shapes.values() if v["steps"] >= 10]
        cell["pred_err_shape_pct"] = round(100 * max(common), 2) if common else None
    return cell


def forced_plain_cell(rt: Runtime, spec: SpecConfig, args: argparse.Namespace, prompts: list[list[int]], b: int,
                      plain: R.PassResult, mean_ctx: float, floor_ms: float, policies: Policies | None,
                      rerun_plain: PlainRerun | None = None) -> dict[str, Any]:
    """The speculative engine with every request's k capped at 0 against the plain engine: what having
    speculation configured (its policy, its proposer, its paths) costs when it never drafts."""
    R.engine_pass(_with_policy(rt, policies, mean_ctx), spec, prompts, min(8, args.max_tokens), b, speculative=True,
                  k_cap=0)  # warm-up
    def measure() -> tuple[R.PassResult, Runtime]:
        rt_m = _with_policy(rt, policies, mean_ctx)
        return R.engine_pass(rt_m, spec, prompts, args.max_tokens, b, speculative=True, k_cap=0), rt_m

    passes = _paired_passes(args.pairs, rerun_plain, measure)
    res, paired, _ = _median_pair(passes, plain)
    ratios = _against_plain(res, plain, paired)
    return {**make_cell("streamsd", "spec k=0", b, res, floor_ms=floor_ms, tokens_per_step=1.0),
            **ratios, **_pair_spread(passes, plain, ratios["measured_speedup"])}


Pair = tuple[R.PassResult, "R.PassResult | None", Runtime]


def _paired_passes(pairs: int, rerun_plain: PlainRerun | None,
                   measure: Callable[[], tuple[R.PassResult, Runtime]]) -> list[Pair]:
    """(measured pass, its plain pass, runtime) × ``pairs`` (one, unpaired, without ``rerun_plain``).
    The plain pass runs first in even pairs and second in odd ones, so that a machine drifting
    steadily over a cell favours neither side."""
    out: list[Pair] = []
    for i in range(pairs if rerun_plain is not None else 1):
        before = rerun_plain() if rerun_plain is not None and i % 2 == 0 else None
        res, rt_m = measure()
        after = rerun_plain() if rerun_plain is not None and i % 2 == 1 else None
        out.append((res, before or after, rt_m))
    return out


def _median_pair(passes: list[Pair], plain: R.PassResult) -> Pair:
    """The (pass, its paired plain pass, runtime) whose TPOT ratio is the median of the pairs': one
    pair's numbers are drift-prone at large batch even against its neighbour (±4 % plain against
    plain on an H200), the median of a few is not. Of an even number the lower middle one: the
    reading must not lean towards speculation (with two pairs the upper one reported 1.37 for
    pairs 1.37 and 0.85)."""
    ranked = sorted(passes, key=lambda x: (x[1] or plain).tpot_ms / x[0].tpot_ms if x[0].tpot_ms else 0.0)
    return ranked[(len(ranked) - 1) // 2]


def _pair_spread(passes: list[Pair], plain: R.PassResult, median: float | None = None) -> dict[str, Any]:
    """Each pair's ratios, and the cell's plain passes against each other (an A/A test: the spread of
    their TPOT): with ``median``, the reported ratio, a verdict against that spread (bench/compare.py)."""
    if len(passes) < 2:
        return {}
    ratios = [_against_plain(res, plain, paired) for res, paired, _ in passes]
    plain_tpot = [(paired or plain).tpot_ms for _, paired, _ in passes]
    spread = spread_of(plain_tpot)
    out: dict[str, Any] = {"pairs": len(passes), **{f"pair_{key}": [r.get(key) for r in ratios]
                                    for key in ("measured_speedup", "decode_step_vs_plain", "decode_speedup")},
           "pair_plain_tpot_ms": [round(t, 3) for t in plain_tpot],
           "plain_spread": None if spread is None else round(spread, 4)}
    if median is not None:
        out["verdict"] = verdict(median, spread)
    return out


def _against_plain(res: R.PassResult, plain: R.PassResult, paired: R.PassResult | None = None) -> dict[str, Any]:
    """A pass's ratios to plain decoding: TPOT, decode step, decode-phase tokens/s.

    ``paired``: a plain pass run beside this one (just before or just after), which the ratios then use. On an H200 the
    same plain work ran up to 30 % slower from one pass to the next at B = 256 (prefill included, so
    the GPU's, not the engine's), and passes late in a grid ran slower than the first plain pass:
    comparing each cell with its neighbour cancels that drift; ``plain_drift`` says how large it was.
    """
    out: dict[str, Any] = {"same_output_as_plain": res.outputs == plain.outputs,
                           "identical_to_plain": f"{identical(res.outputs, plain.outputs)}/{len(plain.outputs)}"}
    if paired is not None:
        out["plain_drift"] = round(paired.tpot_ms / plain.tpot_ms, 3) if plain.tpot_ms else None
        out["paired_plain_tpot_ms"] = round(paired.tpot_ms, 3)
        plain = paired
    out["measured_speedup"] = round(plain.tpot_ms / res.tpot_ms, 3) if res.tpot_ms else 0.0
    if plain.decode_step_ms and res.decode_step_ms:
        out["decode_step_vs_plain"] = round(res.decode_step_ms / plain.decode_step_ms, 3)
    if plain.decode_tokens_per_s and res.decode_tokens_per_s:
        out["decode_speedup"] = round(res.decode_tokens_per_s / plain.decode_tokens_per_s, 3)
    return out


def hf_cells(rt: Runtime, hf: Any, args: argparse.Namespace, prompts: list[list[int]], b: int,
             cells: list[dict[str, Any]], dev: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    pad = rt.tokenizer.pad_token_id if rt.tokenizer.pad_token_id is not None else 0
    out = []
    tpot, tps = R.hf_pass(hf, prompts, args.max_tokens, dev, pad)
    out.append({"engine": "hf", "method": "plain", "batch": b, "tpot_ms": round(tpot, 3), "tokens_per_s": round(tps, 1)})
    ours = next(c for c in cells if c["engine"] == "streamsd" and c["method"] == "plain" and c["batch"] == b)
    ours["hf_tpot_ms"], ours["x_hf_tokens_per_s"] = round(tpot, 3), round(ours["tokens_per_s"] / tps, 2)
    if args.speculative_method in ("ngram", "draft"):
        name = "assisted" if args.speculative_method == "draft" else "prompt-lookup"
        if len(prompts) != 1:  # transformers refuses both for more than one sequence at a time
            out.append({"engine": "hf", "method": name, "batch": b, "note": HF_BATCH_ONE})
            return out
        kw: dict[str, Any] = {"prompt_lookup_num_tokens": args.num_speculative_tokens}
        if args.speculative_method == "draft":
            proposer = rt.worker.proposer
            assert isinstance(proposer, DraftModelProposer)  # what the draft method builds (engine/builder.py)
            draft = R.hf_model(draft_dir(args.draft_model), proposer.model, dev, dtype)
            kw = {"assistant_model": draft, "num_assistant_tokens": args.num_speculative_tokens,
                  "num_assistant_tokens_schedule": "constant"}
        tpot, tps = R.hf_pass(hf, prompts, args.max_tokens, dev, pad, **kw)
        out.append({"engine": "hf", "method": name, "batch": b, "tpot_ms": round(tpot, 3),
                    "tokens_per_s": round(tps, 1)})
    return out


def make_cell(engine: str, method: str, b: int, r: R.PassResult, *, floor_ms: float, tokens_per_step: float) -> dict:
    floor_tpot = floor_ms / max(tokens_per_step, 1e-9)
    return {
        "engine": engine, "method": method, "batch": b, "tpot_ms": round(r.tpot_ms, 3),
        "tokens_per_s": round(r.tokens_per_s, 1), "ttft_ms": round(r.ttft_ms, 2), "tokens": r.tokens,
        "steps": r.steps, "acceptance": None if r.alpha is None else round(r.alpha, 4),
        "draft_acceptance": round(r.acceptance, 4), "drafts_tested": r.tested, "tau": round(r.tau, 3),
        "decode_step_ms": None if r.decode_step_ms is None else round(r.decode_step_ms, 3),
        "decode_steps": r.decode_steps,
        "decode_tokens_per_s": None if r.decode_tokens_per_s is None else round(r.decode_tokens_per_s, 1),
        "decode_step_floor_ratio": round(r.decode_step_ms / floor_ms, 3) if r.decode_step_ms and floor_ms else None,
        "host_ms_per_step": round(r.host_ms, 3), "execute_ms_per_step": round(r.execute_ms, 3),
        "floor_step_ms": round(floor_ms, 3), "floor_tpot_ms": round(floor_tpot, 3),
        "floor_ratio": round(r.tpot_ms / floor_tpot, 3) if floor_tpot else None,
        "kernel_compiles": r.kernel_compiles, "gc_ms": round(r.gc_ms, 1), "device_allocs": r.device_allocs,
        "alloc_retries": r.alloc_retries,
        "decode_step_max_ms": None if r.decode_step_max_ms is None else round(r.decode_step_max_ms, 2),
        "queued_steps_taken": r.queued_taken, "queued_steps_dropped": r.queued_dropped,
    }


def draft_dir(spec: str) -> Path:
    from streamsd.model.loader import resolve_model
    from streamsd.model.presets import is_preset, preset_dir

    return preset_dir(spec) if is_preset(spec) else resolve_model(spec)
