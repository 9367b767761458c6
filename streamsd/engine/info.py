"""What a server reads of an engine, as plain values: fixed facts once it has loaded (`EngineInfo`),
its live counts (`EngineLoad`), and each executed step (`StepReport`).

Built from the core where it runs; the same values cross to a server whose engine runs in another
process (engine/process.py), so the routes and metrics never reach into the core itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streamsd.config import SpecConfig
from streamsd.engine.generation_defaults import GenerationDefaults
from streamsd.policy.chooser import TreeChooser
from streamsd.policy.policy import AdaptivePolicy, SpeculationPolicy
from streamsd.sched.plan import StepPlan

if TYPE_CHECKING:
    from streamsd.engine.core import EngineCore


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_dir: Path
    chat_template: str | None  # used instead of the tokenizer's own; None: the tokenizer's
    model: str  # repr of the model's arguments (its raw config left out), for the fingerprint
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    generation_defaults: GenerationDefaults
    spec: SpecConfig
    exact: bool
    device_type: str
    cache_dtype: str  # "bfloat16", ...

    @classmethod
    def of(cls, core: EngineCore) -> EngineInfo:
        rt, cfg = core.rt, core.scheduler.cfg
        return cls(rt.model_dir, rt.chat_template, repr(rt.args), rt.args.vocab_size, cfg.max_model_len,
                   cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching, rt.generation_defaults, core.spec,
                   rt.exact, rt.worker.device.type, str(rt.worker.cache.data.dtype).removeprefix("torch."))


@dataclass(frozen=True, slots=True)
class PolicyStats:
    """The speculation policy's decisions so far; the adaptive policy's own fields are None under a
    tree chooser."""

    plain_step_share: float  # steps in which nobody drafted
    max_k: int | None = None
    chosen_k: tuple[tuple[int, int], ...] | None = None  # (k, requests and steps it was chosen for)
    last_predicted: float | None = None  # the last observed step's predicted seconds
    last_measured: float | None = None
    prediction_error: float | None = None  # mean |predicted / measured - 1|

    @classmethod
    def of(cls, policy: SpeculationPolicy | None) -> PolicyStats | None:
        if isinstance(policy, TreeChooser):
            return cls(policy.plain_step_share)
        if not isinstance(policy, AdaptivePolicy):
            return None  # a fixed k: nothing chosen
        rec = policy.record
        return cls(rec.plain_step_share, policy.max_k, tuple(sorted(rec.chosen_k.items())), rec.last_predicted,
                   rec.last_measured, rec.mean_abs_prediction_error)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # share of KV blocks held by requests
    pipelined_taken: int = 0  # steps served by a step queued ahead of them (worker/lookahead.py)
    pipelined_dropped: int = 0  # steps queued ahead and dropped (the plan changed)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, found there
    policy: PolicyStats | None = None

    @classmethod
    def of(cls, core: EngineCore, policy: PolicyStats | None) -> EngineLoad:
        s, ahead = core.scheduler, core.rt.worker.lookahead
        return cls(len(s.running), len(s.waiting), s.kv_usage, ahead.taken, ahead.dropped, s.blocks.queries,
                   s.blocks.hits, policy)


@dataclass(frozen=True, slots=True)
class StepReport:
    """An executed step: what it computed and its time (EngineCore.last_step_seconds)."""

    kind: str  # StepPlan.kind; "" for a step that only preempted
    num_tokens: int
    preempted: int  # requests it preempted (their KV recomputed later)
    seconds: float

    @classmethod
    def of(cls, plan: StepPlan, seconds: float) -> StepReport:
        return cls(plan.kind if plan.entries else "", plan.num_tokens, len(plan.preempted), seconds)
