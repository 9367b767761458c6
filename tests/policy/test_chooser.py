"""The tree engine's step chooser (policy/chooser.py): its switch points follow the measured cost table,
it never takes a tree step it expects to emit slower than a plain one, and it learns both the trees'
acceptance and their cost from the steps it observes."""

from __future__ import annotations

import random

import pytest

from streamsd.config import SchedulerConfig
from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.chooser import TreeChooser
from streamsd.policy.policy import Decision, StepShape
from streamsd.request import Request, SamplingParams
from streamsd.sched.plan import EntryResult
from streamsd.sched.scheduler import Scheduler

PLAIN_MS = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.1, 16: 1.2, 32: 1.5, 64: 2.0}
NODES, DEPTH = 24, 4


def _cost(tree_ms: dict[int, float], plain_ms: dict[int, float] = PLAIN_MS, catchup_ms: dict[int, float] | None = None
          ) -> CostTable:
    cost = CostTable.from_samples({b: t * 1e-3 for b, t in plain_ms.items()})
    cost.tree = StepTable.from_samples({b: t * 1e-3 for b, t in tree_ms.items()})
    if catchup_ms:
        cost.catchup = StepTable.from_samples({n: t * 1e-3 for n, t in catchup_ms.items()})
    return cost


def _batch(n: int, max_tokens: int = 1000, prompt: int = 8, temperature: float = 0.0) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=temperature),
                    seed=i, arrival=0.0, spec_k=NODES)
        r.computed = r.draft_computed = prompt - 1  # one pending token, the head caught up
        reqs.append(r)
    return reqs


def _trees(chooser: TreeChooser, reqs: list[Request]) -> bool:
    chooser.choose(reqs, 0, False)
    return chooser.default_k(reqs[0]) > 0


def _step(chooser: TreeChooser, reqs: list[Request], accepted: int, tree_s: float, plain_s: float) -> None:
    """Feeds the chooser the step it chose, as the engine would: the tree step's accepted nodes per
    request, and the step's seconds (`tree_s` or `plain_s`, as it chose)."""
    trees = _trees(chooser, reqs)
    seconds = tree_s if trees else plain_s
    b = len(reqs)
    shape = StepShape(b, b * (1 + NODES), NODES, b, 0, 1 + NODES) if trees else StepShape(b, b, 0, 0, 0, 1)
    verified = [(r, NODES if trees else 0, accepted if trees else 0) for r in reqs]
    chooser.observe(Decision({}, shape=shape), verified, seconds)


def test_cheap_tree_steps_are_chosen_at_batch_8_and_expensive_ones_are_not():
    cheap = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    assert cheap.prior_tau == 3.0
    assert cheap.switch_points() == {1: 1.5, 2: 1.6, 4: 1.8, 8: 2.0, 16: 3.33}  # tree ms / plain ms
    assert _trees(cheap, _batch(8))
    assert not _trees(TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH), _batch(16))
    assert cheap.largest_tree_batch() == 8
    expensive = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 4.0, 16: 8.0}), DEPTH)
    assert not _trees(expensive, _batch(8))
    assert _trees(expensive, _batch(4))
    assert expensive.largest_tree_batch() == 4
    # A tree step dearer than D + 1 plain steps can never pay, whatever the acceptance.
    hopeless = TreeChooser(_cost({1: 6.0}), DEPTH, prior_tau=DEPTH + 1.0)
    assert not _trees(hopeless, _batch(1)) and hopeless.largest_tree_batch(DEPTH + 1.0) == 0


def test_the_switch_point_moves_with_the_acceptance():
    cost = {1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}
    assert not _trees(TreeChooser(_cost(cost), DEPTH, prior_tau=1.8), _batch(8))  # τ 1.8 < break-even 2.0
    assert _trees(TreeChooser(_cost(cost), DEPTH, prior_tau=2.2), _batch(8))
    assert _trees(TreeChooser(_cost(cost), DEPTH, prior_tau=4.0), _batch(16))  # 4.0 > 3.33


def test_no_trees_past_the_largest_batch_a_tree_graph_serves():
    """Past `max_batch` (the tree graphs' largest bucket on CUDA) a tree step would run eagerly, at many
    times the graph's cost: neither the batch nor a request joining it takes trees there. Without the
    limit (no graphs: every batch runs alike) the table's extrapolation prices it; within it, so does a
    bucket the profile left untimed."""
    tree = {1: 1.1, 2: 1.2, 4: 1.3, 8: 1.4}
    chooser = TreeChooser(_cost(tree), DEPTH, prior_tau=DEPTH + 1.0, max_batch=16)
    assert _trees(chooser, _batch(16)) and chooser.joining_k(_batch(1)[0], 16) > 0  # 16 untimed: extrapolated
    assert not _trees(chooser, _batch(17))
    assert chooser.joining_k(_batch(1)[0], 17) == 0 and chooser.tree_seconds(17) == float("inf")
    unlimited = TreeChooser(_cost(tree), DEPTH, prior_tau=DEPTH + 1.0)
    assert unlimited.tree_seconds(17) == pytest.approx(1.4e-3 * 17 / 8)


def test_trees_are_never_chosen_where_their_expected_rate_is_below_plain():
    rng = random.Random(0)
    chosen = 0
    for _ in range(400):
        plain = {b: rng.uniform(0.5, 2.0) * (1 + b / 64) for b in (1, 2, 4, 8, 16, 32)}
        tree = {b: plain[b] * rng.uniform(0.8, 6.0) for b in (1, 2, 4, 8, 16)}
        chooser = TreeChooser(_cost(tree, plain), DEPTH, prior_tau=rng.uniform(1.0, DEPTH + 1.0))
        reqs = _batch(rng.choice([1, 2, 3, 4, 6, 8, 12, 16]), max_tokens=rng.choice([4, 40, 1000]))
        b = len(reqs)
        for _ in range(3):
            if _trees(chooser, reqs):
                chosen += 1
                tree_rate = b * chooser.prior_tau / chooser.tree_seconds(b)
                assert tree_rate > b / chooser.plain_seconds(b)
    assert chosen > 50  # the sweep did exercise both answers


def test_a_batch_whose_trees_are_rejected_goes_plain_and_tries_again_later():
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH, retry_steps=16)
    reqs = _batch(4)
    assert _trees(chooser, reqs)
    steps = 0
    while chooser.speculating and steps < 50:
        _step(chooser, reqs, accepted=0, tree_s=1.8e-3, plain_s=1e-3)  # τ = 1, break-even 1.8
        steps += 1
    assert not chooser.speculating and steps < 10
    assert chooser.summary()["class_tau"]["greedy"] < 1.8
    plain = 0
    while not chooser.speculating and plain < 200:
        _step(chooser, reqs, accepted=0, tree_s=1.8e-3, plain_s=1e-3)
        plain += 1
    assert 5 < plain < 200  # the class's τ drifted back toward its prior: trees are tried again


def test_tree_steps_measured_slow_for_a_while_do_not_keep_trees_off_for_good():
    """A stall makes a few tree steps read ten times their profile: the batch goes plain, and since only
    tree steps correct the tree cell, it would stay plain for good. The cell relaxes toward the plain
    ratio of its batch while the batch decodes plain, so trees come back, and stay while they pay."""
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH, retry_steps=16)
    reqs = _batch(1)
    assert _trees(chooser, reqs)
    stalled = 0
    while chooser.speculating and stalled < 20:
        _step(chooser, reqs, accepted=3, tree_s=15e-3, plain_s=1e-3)  # τ = 4 at 15 ms: plain's 1 token a ms wins
        stalled += 1
    assert not chooser.speculating and chooser.summary()["cost_ratios"]["treex1"] <= 4.0  # clamped
    plain = 0
    while not chooser.speculating and plain < 500:
        _step(chooser, reqs, accepted=3, tree_s=1.5e-3, plain_s=1e-3)
        plain += 1
    assert plain < 500
    for _ in range(20):  # the stall is over: trees at their profile's 1.5 ms, τ = 4, keep being chosen
        _step(chooser, reqs, accepted=3, tree_s=1.5e-3, plain_s=1e-3)
    assert chooser.speculating


def test_requests_with_speculation_off_bring_no_trees_and_no_streams():
    """A request that asked for no speculation emits one token a step whatever the step: a batch of
    them takes plain steps that write no head streams, and in a mixed batch they count at one token."""
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    off = _batch(4)
    for r in off:
        r.spec_k = 0
    decision = chooser.choose(off, 0, False)
    assert not chooser.speculating and not decision.streams
    on = _batch(1)
    # one drafter at the prior τ 3 among three plain ones: (3 + 3) / 1.8 ms against 4 / 1 ms
    assert not _trees(chooser, on + off[:3])
    assert _trees(chooser, on)  # alone, 3 / 1.5 ms against 1 / 1 ms


def test_requests_joining_a_speculating_batch_draft_only_if_trees_pay_at_the_batch_they_join():
    """A wave of new requests reaching a small speculating batch: trees grown for them in their prompt
    step would be dropped by the next step, plain at the wave's size."""
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    running = _batch(2)
    assert _trees(chooser, running)
    (new,) = _batch(1)
    assert chooser.joining_k(new, 3) == NODES  # τ 3 against 1.7 at batch 3
    assert chooser.joining_k(new, 16) == 0  # against 3.33 at batch 16
    assert not _trees(chooser, _batch(16))
    assert chooser.joining_k(new, 16) == 0 and chooser.joining_k(new, 1) == NODES  # the batch decides
    for _ in range(20):
        _step(chooser, running, accepted=0, tree_s=1.6e-3, plain_s=1.0e-3)  # every tree rejected: τ 1
    assert chooser.joining_k(new, 1) == 0  # its class no longer pays even alone


def test_a_request_joining_a_plain_batch_grows_no_tree_the_next_plain_step_would_drop():
    """Trees would pay at the batch it joins by the step prices alone, but the batch decodes plain: its
    next step stays plain unless entering trees pays (`_trees_pay`), and that entering step grows every
    tree anyway. Alone, or joining a speculating batch, the same request grows its tree."""
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    off = _batch(7)
    for r in off:
        r.spec_k = 0
    assert not _trees(chooser, off)
    (new,) = _batch(1)
    assert chooser.break_even(8) * (1.0 + chooser.hysteresis) < chooser.prior_tau  # the prices alone say trees
    assert chooser.joining_k(new, 8) == 0
    assert chooser.joining_k(new, 1) == NODES
    assert _trees(chooser, _batch(7))
    assert chooser.joining_k(new, 8) == NODES


def test_a_scheduled_wave_grows_no_trees_its_batch_will_not_verify():
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    sched = Scheduler(SchedulerConfig(num_blocks=256, max_model_len=256, whole_drafts=True), policy=chooser)

    def admit(n: int, tag: str) -> list[int]:
        for i in range(n):
            sched.add(Request(f"{tag}{i}", [1, 2, 3, 4], SamplingParams(max_tokens=64), seed=i, arrival=0.0,
                              spec_k=NODES))
        plan, _ = sched.schedule()
        sched.update(plan, [EntryResult([5], 0, [], e.start + e.num_tokens) for e in plan.entries])
        return [e.k_next for e in plan.entries]

    assert admit(1, "a") == [NODES]  # alone: its tree pays, grown with its prompt
    assert _trees(chooser, sched.running)
    assert admit(20, "w") == [NODES] + [0] * 20  # the running one draws its tree; the wave's 21 would not pay


def test_well_accepted_trees_keep_being_chosen_where_the_prior_alone_would_not():
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    assert not _trees(chooser, _batch(16))
    reqs = _batch(8)
    for _ in range(20):
        _step(chooser, reqs, accepted=DEPTH, tree_s=2.2e-3, plain_s=1.1e-3)  # every tree accepted to its depth: τ = 5
    assert chooser.speculating
    big = _batch(16)  # new requests start from their class's mean, now near 5: above 16's 3.33
    assert _trees(chooser, big)


def test_measured_step_costs_move_the_switch_points():
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    reqs = _batch(8)
    assert chooser.break_even(8) == 2.2 / 1.1
    for _ in range(8):  # tree steps take twice their profile
        _step(chooser, reqs, accepted=1, tree_s=2 * 2.2e-3, plain_s=1.1e-3)
    # 4 as measured, a little less for the plain steps since the batch left trees (the cell relaxes
    # toward the plain ratio of its batch while no tree step corrects it)
    assert 3.8 < chooser.break_even(8) <= 4.0
    assert not chooser.speculating  # τ 2 against a break-even of about 4 now
    for _ in range(8):  # and plain steps too: drift, which both share
        _step(chooser, reqs, accepted=1, tree_s=2 * 2.2e-3, plain_s=2 * 1.1e-3)
    assert abs(chooser.break_even(8) - 2.0) < 1e-9
    assert chooser.break_even(4) == 1.8  # other batches keep their own cells


def test_entering_trees_pays_for_the_heads_catch_up_within_the_batchs_remaining_tokens():
    cost = _cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}, catchup_ms={64: 2.0, 128: 4.0, 256: 8.0, 512: 16.0})

    def lagging(max_tokens: int) -> list[Request]:
        reqs = _batch(4, max_tokens=max_tokens, prompt=100)
        for r in reqs:
            r.draft_computed = 4  # 95 positions the head skipped while the batch decoded plain
        return reqs

    # 16 ms of catch-up and 2.8 ms of switching, won back within 64 steps of 4 requests: 57 ms against 64 ms.
    assert _trees(TreeChooser(cost, DEPTH), lagging(1000))
    assert not _trees(TreeChooser(cost, DEPTH), lagging(8))  # 8 tokens left cannot repay it
    assert _trees(TreeChooser(cost, DEPTH), _batch(4, max_tokens=8))  # caught up: 7.6 ms against 8 ms
    # Without the catch-up's price the same batch would enter: the cost is what kept it plain.
    assert _trees(TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH), lagging(8))
    assert not _trees(TreeChooser(cost, DEPTH), _batch(4, max_tokens=3))  # nor can 3 tokens repay switching


def test_metrics_export_the_choosers_share_of_plain_steps():
    from types import SimpleNamespace

    from streamsd.engine.info import EngineLoad, PolicyStats
    from streamsd.server.metrics import _AdaptiveCollector

    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH)
    for n in (16, 16, 16, 8):  # three plain steps, then a tree step
        _trees(chooser, _batch(n))
    assert chooser.summary()["plain_steps"] == 3 and chooser.summary()["tree_steps"] == 1
    load = EngineLoad(policy=PolicyStats.of(chooser))
    state = SimpleNamespace(engine=SimpleNamespace(load=lambda: load))
    families = list(_AdaptiveCollector(state).collect())  # type: ignore[arg-type]
    assert [(f.name, f.samples[0].value) for f in families] == [("streamsd:spec_decode_plain_step_share", 0.75)]


def test_a_plain_batch_stops_keeping_streams_and_entering_trees_pays_for_their_recompute():
    """The head's streams are kept while trees run and for `keep_streams_steps` plain steps after; a
    batch whose streams went unkept enters trees only where the target's pass recomputing them is won
    back too (priced by the verify table, by tokens)."""
    chooser = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH, keep_streams_steps=3)
    big = _batch(16)  # plain at 16
    kept = []
    for _ in range(5):
        kept.append(chooser.choose(big, 0, False).streams)
        chooser.observe(Decision({}, shape=StepShape(16, 16, 0, 0, 0, 1)), [(r, 0, 0) for r in big], 1.2e-3)
    assert kept == [True, True, True, False, False] and not chooser.speculating
    assert chooser.choose(_batch(4), 0, False).streams and chooser.speculating

    cost = _cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}, catchup_ms={64: 2.0, 128: 4.0, 256: 8.0, 512: 16.0})

    def lagging(unkept: bool) -> list[Request]:
        reqs = _batch(4, max_tokens=1000, prompt=100)
        for r in reqs:
            r.draft_computed = 4  # 95 positions the head skipped while the batch decoded plain
            r.streams_missing_from = 4 if unkept else None
        return reqs

    # Kept: 16 ms of catch-up and 2.8 ms of switching against 64 steps' 64 ms (57 ms with trees).
    assert _trees(TreeChooser(cost, DEPTH), lagging(False))
    # Unkept: a target pass over 380 positions first, 11.9 ms on this table: 69 ms with trees.
    assert TreeChooser(cost, DEPTH).recompute_seconds(380) == cost.verify(380) > 0.011
    assert not _trees(TreeChooser(cost, DEPTH), lagging(True))


def _entries(chooser: TreeChooser, reqs: list[Request], steps: int, tree_s: float, accepted: int = 3) -> int:
    """Runs `steps` steps at `tree_s` a tree step and 1 ms a plain one; returns how often trees were entered."""
    entered = 0
    for _ in range(steps):
        before = chooser.speculating
        _step(chooser, reqs, accepted=accepted, tree_s=tree_s, plain_s=1e-3)
        entered += chooser.speculating and not before
    return entered


def test_excursions_that_keep_losing_are_retried_ever_more_rarely_and_one_that_pays_resets_that():
    """Tree steps that cost four times their profile in service (τ = 4 at 6 ms: 0.67 tokens a ms against
    plain's 1) lose every excursion: each doubles the wait before the next, so over 4,000 steps the
    batch enters trees about once per few hundred steps at most rather than once every few dozen."""
    reqs = _batch(1, max_tokens=100_000)
    losing = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH, retry_steps=16)
    entered = _entries(losing, reqs, 4000, tree_s=6e-3)
    assert 2 <= entered <= 16 and losing.backoff == losing.max_backoff
    assert losing.plain_step_share > 0.98
    fixed = TreeChooser(_cost({1: 1.5, 2: 1.6, 4: 1.8, 8: 2.2, 16: 4.0}), DEPTH, retry_steps=16, max_backoff=1)
    assert _entries(fixed, reqs, 4000, tree_s=6e-3) > 10 * entered  # what the backoff saves
    # Tree steps back at their profile: the next excursion pays, the backoff resets, trees stay.
    steps = 0
    while not losing.speculating and steps < 20_000:
        _step(losing, reqs, accepted=3, tree_s=1.5e-3, plain_s=1e-3)
        steps += 1
    assert losing.speculating
    for _ in range(50):
        _step(losing, reqs, accepted=3, tree_s=1.5e-3, plain_s=1e-3)
    assert losing.speculating
    _step(losing, reqs, accepted=0, tree_s=1.5e-3, plain_s=1e-3)  # keeps trees: one bad step moves τ a little
    losing.observe(Decision({}, shape=StepShape(1, 1, 0, 0, 0, 1)), [(reqs[0], 0, 0)], 1e-3)  # a plain step ends it
    assert losing.backoff == 1
