"""Continuous batching over a paged KV pool. Knows nothing of torch.

Each step the scheduler plans, per request, which of its tokens the target computes: a prefill
chunk, or everything still pending plus the drafts cached in the request (verification). The
target and the draft model share one block table per request: both caches are pools of the same
block ids, so one accounting covers both (the draft cache never runs ahead of target + k).

Blocks are reserved before a step for the most it can write (pending + drafts + the next
drafts, and for a request that drafts, the worker's own margin past them: SchedulerConfig.drafting_reserve)
and trimmed after it to the tokens actually kept (the pending one included: every running request
computes it next; for a request that drafts, SchedulerConfig.drafting_keep tokens past them), so the
cache holds accepted tokens only.
When blocks run out, the newest running request is preempted by recompute; its drafts stay.

With prefix caching (sched/prefix_cache.py) a request admitted with no KV first takes the cached full
blocks of its tokens' longest cached prefix, shared by reference count, and computes only the rest;
its own blocks are cached as they fill with final KV. Blocks nobody holds stay cached until a
request needs them (sched/block_pool.py), so after all requests finish, free + evictable == total.
"""

from __future__ import annotations

from collections import deque

from streamsd.config import SchedulerConfig
from streamsd.policy.policy import Decision, FixedPolicy, SpeculationPolicy, cap_k
from streamsd.request import FinishReason, Request, Status
from streamsd.sched.block_pool import BlockPool
from streamsd.sched.plan import EntryResult, Pin, Pinning, Scheduled, StepPlan
from streamsd.sched.prefix_cache import PrefixCache


class AdmissionError(ValueError):
    """The request can never run here (too long for the context window)."""


class QueueFullError(RuntimeError):
    pass


def check_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """A request's prompt is not empty, and it and max_tokens fit the context window."""
    if prompt_tokens == 0:
        raise AdmissionError("the prompt is empty")
    need = prompt_tokens + max_tokens
    if need > max_model_len:
        raise AdmissionError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {need} exceeds "
                             f"the context window of {max_model_len} tokens")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, *, dense_q_slots: int = 0, policy: SpeculationPolicy | None = None):
        self.cfg = cfg
        self.policy: SpeculationPolicy = policy or FixedPolicy()
        self.blocks = BlockPool(cfg.num_blocks, cfg.block_size)
        self.prefix = PrefixCache(self.blocks, enabled=cfg.enable_prefix_caching, draft_kv=cfg.prefix_draft_kv,
                                  streams=cfg.prefix_streams, next_tokens=cfg.prefix_next_tokens)
        self.q_slots_free = list(range(dense_q_slots - 1, -1, -1))
        self.q_slots_total = dense_q_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._aborts: set[str] = set()
        self._ahead: Decision | None = None  # the next step's k, chosen while this one runs

    # -- admission ---------------------------------------------------------------------------
    def add(self, r: Request) -> None:
        check_fits(len(r.prompt_ids), r.params.max_tokens, self.cfg.max_model_len)
        need = len(r.prompt_ids) + r.params.max_tokens
        past_end = r.spec_k if self.cfg.drafts_past_max_tokens else 0  # drafts verified past max_tokens
        if self._blocks_for(need + max(r.spec_k, self.cfg.draft_window) + 1 + self.cfg.drafting_reserve + past_end) \
                > self.blocks.total:
            raise AdmissionError(f"the request needs {need} tokens of KV cache, more than the pool holds")
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFullError("the waiting queue is full; retry later")
        self.waiting.append(r)

    def abort(self, request_id: str) -> None:
        """Takes effect at the next step boundary, never under a running step."""
        self._aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # -- planning ----------------------------------------------------------------------------
    def schedule(self, pin: Pinning | None = None) -> tuple[StepPlan, list[Request]]:
        """Returns the plan and the requests aborted since the last step (now finished). `pin`, given
        the k each running request gets this step, returns the requests whose drafts the caller
        fixes instead (`Pinning`): they verify and propose those, within what they hold and have left."""
        aborted = self._apply_aborts()
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens
        decision, self._ahead = self._ahead or self._choose_k(), None  # planned ahead, or now
        depth = self._depth(decision)
        pinned = pin(lambda r: self._k_for(r, decision, depth)) if pin is not None else {}
        for r in list(self.running):
            if r.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            entry = self._plan_one(r, budget, self._k_for(r, decision, depth), pinned.get(id(r)),
                                   decision.verify.get(r.request_id, 0))
            if entry is None:
                continue
            while not self._reserve(r, entry):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is r:
                    break
            if r.status is Status.RUNNING:
                plan.entries.append(entry)
                budget -= entry.num_tokens + entry.num_drafts
        # The batch the admitted requests join once their prompts are through: at most every running
        # request and as many waiting ones as may run.
        joining = min(len(self.running) + len(self.waiting), self.cfg.max_num_seqs)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            r = self.waiting[0]
            if self._wants_q_slot(r) and r.q_slot is None and not self.q_slots_free:
                break
            hit = self.prefix.claim(r)
            entry = self._plan_one(r, budget, self.policy.joining_k(r, joining))
            if entry is None or not self._reserve(r, entry):
                self._release(r)
                break
            self.prefix.admitted(r, hit)
            self.waiting.popleft()
            if self._wants_q_slot(r) and r.q_slot is None:
                r.q_slot = self.q_slots_free.pop()
            r.status = Status.RUNNING
            self.running.append(r)
            plan.entries.append(entry)
            budget -= entry.num_tokens + entry.num_drafts
        self.policy.commit(decision, plan)
        plan.decision = decision
        return plan, aborted

    def plan_ahead(self, running: StepPlan) -> None:
        """Chooses the next step's k now, while `running` executes: the planner's host time then
        hides behind the GPU's instead of adding to every step. The plan sees acceptance up to the
        previous step, and the batch as it will be once `running` is through (prompts it completes
        decode next); `schedule` re-applies each request's caps (drafts cached, tokens left), gives
        requests that join decoding `default_k`, and commits the step as built. Exactness does not
        depend on k, only speed does."""
        if self.running and self.policy.plans_ahead:
            self._ahead = self._choose_k(running)

    def _choose_k(self, running: StepPlan | None = None) -> Decision:
        """The policy's k for every decoding request (one token pending, drafts maybe cached), as of
        the end of `running` when given."""
        through = {id(e.request): e for e in running.entries} if running is not None else {}
        decoding, prefill = [], 0
        for r in self.running:
            e = through.get(id(r))
            pending = 1 if e is not None and e.verifies else r.num_tokens - (
                e.start + e.num_tokens if e is not None else r.computed)
            if pending == 1:
                decoding.append(r)
            else:
                prefill += pending
        prefill += sum(r.num_tokens - self.prefix.peek(r) for r in list(self.waiting)[:4])
        return self.policy.choose(decoding, min(prefill, self.cfg.max_num_batched_tokens), bool(self.waiting))

    def _k_for(self, r: Request, decision: Decision, depth: int | None = None) -> int:
        """The request's k this step. Where drafts run past max_tokens (SchedulerConfig.drafts_past_max_tokens)
        a k that max_tokens cut is raised to the step's `depth` (`_depth`), or where the policy gave
        no per-request k, to the drafts it proposed last step: the k of the chain it is in."""
        k = decision.ks.get(r.request_id)
        k = self.policy.default_k(r) if k is None else k
        if self.cfg.drafts_past_max_tokens and r.remaining_tokens <= r.spec_k and k == cap_k(r):
            return max(k, min(r.spec_k, len(r.draft_ids) if depth is None else depth))
        return k

    def _depth(self, decision: Decision) -> int | None:
        """The step's largest planned k, if the policy planned one per request (None: it did not). A
        max over the dict's values: the scheduler's per-step Python stays O(1) per request."""
        if not self.cfg.drafts_past_max_tokens or not decision.ks:
            return None
        return max(decision.ks.values())

    def _plan_one(self, r: Request, budget: int, k: int,
                  pinned: Pin | None = None, verify_at_least: int = 0) -> Scheduled | None:
        """k: drafts to verify now and to propose next; pinned: (to verify, to propose) instead, as the
        caller fixed them (`schedule`'s pin); verify_at_least: drafts to verify where k says fewer (a
        probe's, proposed in the step before)."""
        verify_k, k = (max(k, verify_at_least), k) if pinned is None else pinned
        pending = r.num_tokens - r.computed
        # What max_tokens leaves, unless drafts run past it (their tokens are cut when appended).
        left = self.cfg.max_model_len - r.num_tokens + 1 if self.cfg.drafts_past_max_tokens else r.remaining_tokens
        drafts = min(len(r.draft_ids), verify_k, max(left - 1, 0))
        k_next = max(min(k, left - 2, self.cfg.max_model_len - r.num_tokens - drafts - 1), 0)
        if self.cfg.whole_drafts and k > 0:  # a tree: whole, or not at all
            fits = self.cfg.max_model_len - r.num_tokens
            drafts = len(r.draft_ids) if verify_k > 0 and len(r.draft_ids) < fits else 0
            k_next = r.spec_k if r.remaining_tokens >= 3 and r.spec_k < fits - drafts else 0
        if k_next and r.num_tokens + drafts + self.cfg.draft_window > self.cfg.max_model_len:
            k_next = 0  # the drafter's window would pass the end of the context
        if pending + drafts <= budget:
            return Scheduled(r, r.computed, pending, drafts, k_next)
        chunk = min(pending - 1, budget)  # leave the last token so its drafts are verified with it
        return Scheduled(r, r.computed, chunk, 0, 0) if chunk > 0 else None

    def _wants_q_slot(self, r: Request) -> bool:
        return self.q_slots_total > 0 and r.spec_k > 0 and not r.greedy_draft

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _reserve(self, r: Request, e: Scheduled) -> bool:
        end = e.start + e.num_tokens + e.num_drafts
        if e.verifies:
            # the next drafts are written by the draft model in this step (or a head's tree window)
            grows = e.k_next or (self.cfg.whole_drafts and e.num_drafts)  # a tree step always grows the next
            end += 1 + (max(e.k_next, self.cfg.draft_window) if grows else 0)
            if e.k_next:
                end += self.cfg.drafting_reserve  # and the worker writes further
        need = self._blocks_for(min(end, self.cfg.max_model_len + 1)) - len(r.blocks)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        r.blocks.extend(self.blocks.take(need))
        return True

    def _release(self, r: Request) -> None:
        """Lets go of every block `r` holds (cached ones stay cached): it computes from scratch next."""
        self.blocks.give(r.blocks)
        r.blocks = []
        r.computed = r.draft_computed = 0
        self.prefix.forget(r)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._release(r)
        r.status = Status.WAITING
        r.num_preemptions += 1
        self.waiting.appendleft(r)  # drafts and q slot stay with the request

    # -- after the step ----------------------------------------------------------------------
    def update(self, plan: StepPlan, results: list[EntryResult]
               ) -> list[tuple[Scheduled, EntryResult, list[int], int]]:
        """Apply a step's results; returns (entry, result, tokens appended, drafts that could be emitted)
        for verifying entries."""
        emitted = []
        for e, res in zip(plan.entries, results, strict=True):
            r = e.request
            if r.finished:
                continue
            if res.prompt_logprobs:
                # A prompt computed again (after a preemption) scores what is scored already: kept once.
                r.prompt_logprobs.extend(res.prompt_logprobs[max(len(r.prompt_logprobs) - e.start, 0) :])
            if not e.verifies:
                r.computed = e.start + e.num_tokens
                r.draft_computed = max(r.draft_computed, res.draft_computed)
                self.prefix.register(r)
                continue
            r.computed = e.start + e.num_tokens + res.num_accepted
            r.draft_computed = res.draft_computed
            r.draft_ids = list(res.draft_ids)
            r.draft_parents = list(res.draft_parents)
            # A chain's drafts verified past max_tokens (SchedulerConfig.drafts_past_max_tokens) could never
            # be emitted: not counted as drafted (a tree's nodes are not positions: all count). Nor is the
            # one at the last position max_tokens leaves: the bonus token fills it anyway, so a plan without
            # drafts past max_tokens never drafts it (`_plan_one`), and with them or not, the counts agree.
            # Drafts accepted past a stop are not emitted either: count only what the client receives.
            usable = e.num_drafts if self.cfg.whole_drafts else min(e.num_drafts, max(r.remaining_tokens - 1, 0))
            kept = self._append(r, res.new_tokens)
            r.stats.record(usable, min(res.num_accepted, len(kept), usable), len(kept))
            if r.finished:
                # Cached before its blocks are released: a request answered in its first step (one token, a
                # stop at once, a prompt-only score) leaves its prompt for the next one as a longer one does.
                self.prefix.register(r)
                self.finish(r, r.finish_reason or FinishReason.STOP)
            else:
                self._trim(r)
                self.prefix.register(r)
            emitted.append((e, res, kept, usable))
        return emitted

    def _append(self, r: Request, tokens: list[int]) -> list[int]:
        p = r.params
        if p.max_tokens == 0:  # the prompt alone was asked for: its last chunk's token is not output
            r.finish_reason, r.status = FinishReason.LENGTH, Status.FINISHED
            return []
        kept = []
        for t in tokens:
            r.output_ids.append(t)
            kept.append(t)
            n = len(r.output_ids)
            if n >= p.min_tokens and r.stops_on(t):
                r.finish_reason = FinishReason.STOP
            elif n >= p.max_tokens:
                r.finish_reason = FinishReason.LENGTH
            if r.finish_reason is not None:
                r.status = Status.FINISHED
                break
        return kept

    def _trim(self, r: Request) -> None:
        margin = self.cfg.drafting_keep if r.draft_ids else 0  # KV the worker may still write for it
        keep = self._blocks_for(max(r.num_tokens + margin, r.draft_computed))
        if len(r.blocks) > keep:
            self.blocks.give(r.blocks[keep:])
            del r.blocks[keep:]

    def finish(self, r: Request, reason: FinishReason) -> None:
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self.blocks.give(r.blocks)
        r.blocks = []
        self.prefix.forget(r)
        if r.q_slot is not None:
            self.q_slots_free.append(r.q_slot % self.q_slots_total)  # the worker may have moved it to its pair
            r.q_slot = None
        r.draft_ids = []
        r.draft_parents = []
        r.status = Status.FINISHED
        r.finish_reason = r.finish_reason or reason

    def _apply_aborts(self) -> list[Request]:
        done = []
        for r in [*self.running, *self.waiting]:
            if r.request_id in self._aborts:
                r.finish_reason = FinishReason.ABORT
                self.finish(r, FinishReason.ABORT)
                done.append(r)
        self._aborts.clear()
        return done

    # -- accounting --------------------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        """Blocks held by requests (cached blocks nobody holds are reusable: not counted)."""
        return 1.0 - self.blocks.num_free / self.blocks.total
