"""The scheduler's boundary: it plans in tokens. What the worker does beyond a plan reaches it only as
numbers (drafts pinned per request, KV margins in tokens), never as the worker's own objects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import streamsd.sched
from streamsd.config import SchedulerConfig
from streamsd.request import Request, SamplingParams
from streamsd.sched.plan import EntryResult
from streamsd.sched.scheduler import Scheduler

PLANNING = ("streamsd.sched", "streamsd.config", "streamsd.policy", "streamsd.request")


def test_sched_modules_import_only_the_planning_side_of_the_package() -> None:
    """Not even for type checking: no module under sched/ names the worker, the engine or the models."""
    imported: set[str] = set()
    for path in Path(streamsd.sched.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
    ours = {m for m in imported if m.split(".")[0] == "streamsd"}
    assert "streamsd.sched.plan" in ours and all(m.startswith(PLANNING) for m in ours), sorted(ours)
    assert "torch" not in imported


def test_importing_the_scheduler_loads_no_worker_engine_or_model_module() -> None:
    """What sched/ imports (the policy among them) pulls in none of them either."""
    code = ("import sys, streamsd.sched.scheduler; print(' '.join(m for m in sys.modules if m == 'torch' or "
            "m.startswith(('streamsd.worker', 'streamsd.engine', 'streamsd.model', 'streamsd.spec_decode'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "streamsd.sched" not in out and out.split() == []


def _drafting(sched: Scheduler, *ids: str) -> list[Request]:
    """Requests of k = 4 that each hold 4 drafts after their prompt step."""
    reqs = [Request(i, [1, 2, 3], SamplingParams(max_tokens=40), seed=0, arrival=0.0, spec_k=4) for i in ids]
    for r in reqs:
        sched.add(r)
    plan, _ = sched.schedule()
    sched.update(plan, [EntryResult([5], 0, [7] * 4, e.start + e.num_tokens) for e in plan.entries])
    return reqs


def test_pinned_requests_verify_and_propose_what_the_caller_pins() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=512))
    a, b, c = _drafting(sched, "a", "b", "c")
    seen: dict[str, int] = {}

    def pin(k_of):
        seen.update({r.request_id: k_of(r) for r in (a, b, c)})
        return {id(a): (4, 1), id(b): (0, 0)}

    plan, _ = sched.schedule(pin)
    assert seen == {"a": 4, "b": 4, "c": 4}  # the k each would get
    got = {e.request.request_id: (e.num_drafts, e.k_next) for e in plan.entries}
    assert got == {"a": (4, 1), "b": (0, 0), "c": (4, 4)}


def test_a_pin_verifies_no_more_drafts_than_the_request_holds() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=512))
    (a,) = _drafting(sched, "a")
    plan, _ = sched.schedule(lambda k_of: {id(a): (6, 2)})
    assert [(e.num_drafts, e.k_next) for e in plan.entries] == [(4, 2)]


def test_kv_margins_are_held_for_drafting_requests_only() -> None:
    """drafting_reserve tokens past a step that proposes drafts; drafting_keep past the known tokens of
    a request that holds drafts, when its blocks are trimmed after the step."""

    def blocks(reserve: int, keep: int, spec_k: int) -> tuple[int, int]:
        sched = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=512, block_size=4, drafting_reserve=reserve,
                                          drafting_keep=keep))
        r = Request("r", [1, 2, 3], SamplingParams(max_tokens=40), seed=0, arrival=0.0, spec_k=spec_k)
        sched.add(r)
        plan, _ = sched.schedule()  # 3 prompt tokens, the next one sampled, 2 drafts proposed
        reserved = len(r.blocks)
        sched.update(plan, [EntryResult([5], 0, [7] * spec_k, 3)])  # 4 tokens known
        return reserved, len(r.blocks)

    assert blocks(0, 0, 2) == (2, 1)  # 3 + 1 + 2 positions, then the 4 known
    assert blocks(10, 6, 2) == (4, 3)  # 16 positions, then 4 + 6
    assert blocks(10, 6, 0) == (1, 1)  # no drafts: no margin
