"""The measuring parts of `streamsd bench offline`: one engine pass, one HF transformers pass, the
draft cost ratio, and the physical floor. Pure functions over a built runtime; no printing."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsd.config import SpecConfig
from streamsd.engine.builder import Runtime
from streamsd.engine.core import EngineCore
from streamsd.model.arch import ModelArgs
from streamsd.model.llama import Transformer
from streamsd.request import SamplingParams
from streamsd.worker.cuda import capture_all
from streamsd.worker.profile import sync, time_step

HBM_BYTES_PER_S = 4.25e12  # device-to-device copy bandwidth measured on an H200


@dataclass(frozen=True, slots=True)
class PassResult:
    outputs: list[list[int]]  # per prompt, the generated ids
    wall_s: float
    tpot_ms: float  # mean over requests of (last - first token time) / (tokens - 1)
    ttft_ms: float
    tokens: int
    steps: int
    drafted: int
    accepted: int
    emitted: int  # tokens emitted by verify steps (the denominator of tau)
    verify_steps: int
    tested: int  # drafts whose accept test ran: min(accepted + 1, drafted) per step
    host_ms: float  # per step: the serial host part (scheduling, applying results); the GPU idles meanwhile
    execute_ms: float  # per step: the worker's step, its one wait for the GPU included
    # Median wall time (schedule + execute + postprocess) of the steps in which every entry decodes
    # or verifies (no prompt chunk rides along): what one decode step costs, unlike TPOT, which at a
    # large batch also carries other requests' prefill chunks. None when no step was one.
    decode_step_ms: float | None = None
    decode_steps: int = 0
    # Tokens those decode-only steps emitted per second of their wall time: speculation's gain in the
    # steady state. TPOT at B >= 128 is mostly where the prompts' chunks landed (all prompts arrive
    # at once and a spec step's verify tokens share the token budget with them).
    decode_tokens_per_s: float | None = None
    # Triton kernel variants compiled during the pass (each one a stall of a few hundred ms inside a
    # step; the start-up warm-up should leave none). None off CUDA.
    kernel_compiles: int | None = None
    # What can stall a step besides a compile: the garbage collector (ms in collections during the
    # pass) and the CUDA allocator (new device segments, and retries after freeing its cache).
    gc_ms: float = 0.0
    device_allocs: int | None = None
    alloc_retries: int | None = None
    decode_step_max_ms: float | None = None
    # Steps served by one queued ahead on the device (worker/lookahead.py), and queued steps thrown away.
    queued_taken: int = 0
    queued_dropped: int = 0

    @property
    def alpha(self) -> float | None:
        """Per-draft acceptance given the drafts before it were accepted: the alpha of the
        i.i.d. model (accepted / drafted is lower, since drafts after a rejection are never tested).
        None when no draft was tested (e.g. an adaptive policy that never speculated): that is not
        an acceptance of 0."""
        return self.accepted / self.tested if self.tested else None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the bonus token included."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0


def engine_pass(rt: Runtime, spec: SpecConfig, prompts: list[list[int]], max_tokens: int, batch: int,
                speculative: bool, k_cap: int | None = None) -> PassResult:
    """All prompts through a fresh EngineCore admitting `batch` at a time; greedy, EOS ignored.
    `k_cap`: every request's per-request draft cap (0: speculation configured, never used)."""
    sched = dataclasses.replace(rt.scheduler_config, max_num_seqs=batch)
    core = EngineCore(dataclasses.replace(rt, scheduler_config=sched), spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, speculative=speculative,
                            num_speculative_tokens=k_cap)
    ids = [f"p{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
        core.add_request(rid, p, dataclasses.replace(params, seed=i + 1))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts = dict.fromkeys(ids, 0)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = tested = 0
    host = execute = 0.0
    decode_steps: list[float] = []
    decode_tokens = 0
    sync(rt.worker.device)
    stalls = _stall_counters(rt.worker.device)
    lookahead = rt.worker.lookahead
    taken, dropped = lookahead.taken, lookahead.dropped
    gc_watch = _GcWatch()
    gc.callbacks.append(gc_watch)
    t0 = time.perf_counter()
    for turn in core.run():  # the engine's own pipeline: step N+1 executes while step N is detokenised
        now = time.perf_counter()
        host += turn.serial_s
        execute += turn.execute_s
        steps += 1
        # Every entry one token (a decode or a verify, at worst a prompt's one-token tail): no prompt chunk.
        if turn.plan.entries and all(e.num_tokens == 1 for e in turn.plan.entries):
            decode_steps.append(turn.serial_s + turn.execute_s)
            decode_tokens += sum(len(o.token_ids) for o in turn.outputs)
        for o in turn.outputs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            if o.step_drafted:
                tested += min(o.step_accepted + 1, o.step_drafted)
            if o.token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                counts[o.request_id] += len(o.token_ids)
                outputs[o.request_id].extend(o.token_ids)
    wall = time.perf_counter() - t0
    gc.callbacks.remove(gc_watch)
    end = _stall_counters(rt.worker.device)  # what the pass added: compiles, device segments, allocator retries
    stalls = [a - b for a, b in zip(end, stalls, strict=True)] if end and stalls else None
    tpots = [(last[r] - first[r]) / (counts[r] - 1) for r in ids if counts[r] > 1]
    st = core.totals
    return PassResult(
        outputs=[outputs[r] for r in ids], wall_s=wall, tpot_ms=1e3 * sum(tpots) / max(len(tpots), 1),
        ttft_ms=1e3 * sum(first[r] - t0 for r in first) / max(len(first), 1), tokens=sum(counts.values()),
        steps=steps, drafted=st.drafted, accepted=st.accepted, emitted=st.emitted, verify_steps=st.steps,
        tested=tested, host_ms=1e3 * host / max(steps, 1), execute_ms=1e3 * execute / max(steps, 1),
        decode_step_ms=1e3 * statistics.median(decode_steps) if decode_steps else None,
        decode_steps=len(decode_steps),
        decode_tokens_per_s=decode_tokens / sum(decode_steps) if decode_steps else None,
        kernel_compiles=stalls[0] if stalls else None, device_allocs=stalls[1] if stalls else None,
        alloc_retries=stalls[2] if stalls else None, gc_ms=1e3 * gc_watch.seconds,
        decode_step_max_ms=1e3 * max(decode_steps) if decode_steps else None,
        queued_taken=lookahead.taken - taken, queued_dropped=lookahead.dropped - dropped,
    )


def unpipelined_pass(rt: Runtime, spec: SpecConfig, prompts: list[list[int]], max_tokens: int,
                     batch: int) -> PassResult:
    """A plain pass with the worker's lookahead off (each step read before the next is queued)."""
    lookahead = rt.worker.lookahead
    was, lookahead.enabled = lookahead.enabled, False
    try:
        return engine_pass(rt, spec, prompts, max_tokens, batch, speculative=False)
    finally:
        lookahead.enabled = was


class _GcWatch:
    """A gc callback summing the time spent in collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def _stall_counters(device: torch.device) -> list[int] | None:
    """Triton kernel variants compiled so far, CUDA allocator device segments and retries (None off CUDA)."""
    if device.type != "cuda":
        return None
    from streamsd.kernels.warmup import compiled_variants

    st = torch.cuda.memory_stats(device)
    return [compiled_variants(), st.get("num_device_alloc", 0), st.get("num_alloc_retries", 0)]


def capture_graphs(rt: Runtime, batch: int) -> None:
    """Capture every graph a pass over `batch` requests can use, so no capture lands in a timing."""
    capture_all(rt.worker, batch)


def draft_cost_ratio(rt: Runtime, batch: int) -> float:
    """c: one draft-model step over one target step at this batch size (0 without a draft model)."""
    draft = rt.worker.proposer.draft_model() if rt.worker.proposer is not None else None
    if draft is None:
        return 0.0
    # Timed the way the adaptive policy's start-up profile times a step: B requests x 1 token.
    t_draft = time_step(draft.model, draft.cache, draft.graphs, batch, 1, 0, 20)
    t_target = time_step(rt.worker.target, rt.worker.cache, rt.worker.graphs, batch, 1, 0, 20)
    return t_draft / t_target


def analytic_speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup of greedy speculation with i.i.d. acceptance alpha, k drafts, draft cost c."""
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (1.0 + k * c)


def weight_bytes_read(args: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes of weights one step reads: everything but an untied embedding (only B rows of it)."""
    unread = 0 if args.tie_embeddings else args.vocab_size * args.hidden_size
    return (args.num_params() - unread) * torch.finfo(dtype).bits // 8


def floor_step_ms(args: ModelArgs, dtype: torch.dtype, batch: int, mean_ctx: float,
                  draft: ModelArgs | None = None, k: int = 0) -> float:
    """HBM floor of one step: target weights + its KV at the mean context, plus k draft steps."""
    total = weight_bytes_read(args, dtype) + batch * mean_ctx * args.kv_bytes_per_token(dtype)
    if draft is not None and k:
        total += k * (weight_bytes_read(draft, dtype) + batch * mean_ctx * draft.kv_bytes_per_token(dtype))
    return 1e3 * total / HBM_BYTES_PER_S


# -- HF transformers, the same model side by side -------------------------------------------------
def hf_model(model_dir: Path, ours: Transformer, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model of the same checkpoint, sharing our weights' storage (no second copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v for k, v in ours.state_dict().items() if not k.startswith("rope_")}
    model.load_state_dict(state, strict=False, assign=True)
    with torch.device(device):  # its inv_freq buffers were made on meta
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def hf_pass(model: Any, prompts: list[list[int]], max_tokens: int, device: torch.device, pad_id: int,
            **gen_kwargs: Any) -> tuple[float, float]:
    """(TPOT ms, tokens/s) of HF `generate` on one left-padded batch; TPOT excludes the prefill."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # [B, L]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # [B, L]

    def gen(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad_id, **gen_kwargs)
        sync(device)
        return time.perf_counter() - t0

    gen(2)  # warm-up
    t_one, t_all = gen(1), gen(max_tokens)
    tpot = (t_all - t_one) / max(max_tokens - 1, 1)
    return 1e3 * tpot, len(prompts) * max_tokens / t_all
