"""Draft trees (spec_decode/tree.py, spec_decode/eagle/tree.py, sample/tree_verify.py): the walk, the masks, the head's
growth, and the engine's exactness with trees on tiny random targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from streamsd import LLM, SamplingParams
from streamsd.config import SpecConfig, TreeShape
from streamsd.engine.builder import load_model
from streamsd.model.attention import paged_attention
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.tree_layout import NONE, ROOT, Race
from streamsd.sample import rng
from streamsd.sample.sampler import sample_keyed
from streamsd.sample.tree_verify import host_tree
from streamsd.sample.warp import WarpParams
from streamsd.spec_decode.eagle.tree import grow, race_logits
from streamsd.spec_decode.tree import ancestor_bits, depths, path_moves, select, walk, window_bits
from tests.engine.test_engine import (
    MAX_TOKENS,
    PROMPTS,
    _assert_free,
    assert_pairs_follow_target,
    greedy_params,
    hf_greedy,
)
from tests.spec_decode.test_eagle import _chained_engine, _train_head

CPU = torch.device("cpu")
# A tree over nodes 0..5: the root's children 0 (token 5) and 1 (7); 0's children 2 (9) and 3 (4);
# 2's child 4 (1); node 5 is padding.
PARENTS = torch.tensor([[ROOT, ROOT, 0, 0, 2, NONE]])
TOKENS = torch.tensor([[5, 7, 9, 4, 1, 0]])


@pytest.fixture(scope="module")
def head(tiny_model_dir, tmp_path_factory):
    return _train_head(tiny_model_dir, tmp_path_factory.mktemp("tree_head"), "eagle3_norm_first")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)


def test_depths_and_masks_of_a_small_tree():
    assert depths(PARENTS, 4).tolist() == [[1, 1, 2, 2, 3, 1]]
    assert ancestor_bits(PARENTS, 4).tolist() == [[0b1, 0b10, 0b101, 0b1001, 0b10101, 0b100000]]
    # window rows: the root, then node i at 1 + i; every real node sees the root, padding only itself
    assert window_bits(PARENTS, 4).tolist() == [[0b1, 0b11, 0b101, 0b1011, 0b10011, 0b101011, 0b1000000]]
    depth, bits = host_tree(PARENTS[0, :5].tolist())
    assert depth == [0, 1, 1, 2, 2, 3] and bits == window_bits(PARENTS[:, :5], 4)[0].tolist()


@pytest.mark.parametrize("target,emitted,path", [
    ([5, 9, 0, 1, 0, 3, 0], [5, 9, 1, 3, -1], [0, 2, 4, -1]),  # down the deepest branch, bonus 3
    ([7, 9, 0, 1, 0, 3, 0], [7, 0, -1, -1, -1], [1, -1, -1, -1]),  # the second child, then node 1's row
    ([5, 4, 0, 1, 0, 3, 0], [5, 4, 0, -1, -1], [0, 3, -1, -1]),  # a sibling at depth 2
    ([8, 9, 0, 1, 0, 3, 0], [8, -1, -1, -1, -1], [-1, -1, -1, -1]),  # no child holds the root's token
    ([0, 9, 0, 1, 0, 3, 0], [0, -1, -1, -1, -1], [-1, -1, -1, -1]),  # padding (token 0) is never a child
])
def test_walk_follows_the_targets_tokens_down_the_tree(target, emitted, path):
    out, accepted, taken = walk(torch.tensor([target]), TOKENS, PARENTS, 4)
    assert out.tolist() == [emitted] and taken.tolist() == [path]
    assert accepted.tolist() == [sum(p >= 0 for p in path)]
    src, dst = path_moves(torch.tensor([10]), taken)
    a = accepted.item()
    assert src[0, :a].tolist() == [11 + p for p in path[:a]] and dst[0, :a].tolist() == list(range(11, 11 + a))
    assert (src[0, a:] == 10).all() and (dst[0, a:] == 10).all()  # no-op moves stay on the root's slot


def test_select_keeps_every_ancestor_and_lists_parents_first():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        c = 40
        parents = torch.full((3, c), ROOT)
        for i in range(4, c):
            parents[:, i] = torch.randint(0, i, (3,), generator=g)
        step = -torch.rand(3, c, generator=g)  # log-probabilities
        step[:, 7] = 0.0  # a certain child: ties its parent's score
        scores = step.clone()
        for i in range(c):  # a path's score is its parent's plus its own step
            up = parents[:, i]
            scores[:, i] += torch.where(up >= 0, scores.gather(1, up.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        tokens = torch.arange(c).expand(3, c)
        kept, kept_parents, kept_scores = select(scores, tokens, parents, 12)
        assert (kept_scores[:, :-1] >= kept_scores[:, 1:]).all()  # best first
        for b in range(3):
            for i, p in enumerate(kept_parents[b].tolist()):
                assert p == ROOT or 0 <= p < i  # parents first, so any prefix is a tree
                if p != ROOT:
                    assert parents[b, kept[b, i]] == kept[b, p]  # the kept parent is the candidate's parent
            assert set(kept[b].tolist()) == set(torch.sort(scores[b], descending=True, stable=True).indices[:12].tolist())


def test_walking_sampled_rows_emits_the_targets_distribution():
    """Each row's token drawn as a plain step draws it (the race against (seed, position) noise): the
    first emitted token follows the root's distribution and the second the accepted child's row."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 12, 6000
    logits = torch.randn(7, vocab, generator=g) * 2  # window rows: root + 6 nodes
    tokens = torch.tensor([[int(logits[0].argmax()), int(logits[0].argsort()[-2]), 3, 4, 1, 6]])
    parents = torch.tensor([[ROOT, ROOT, 0, 0, 2, 1]])
    depth = torch.tensor(host_tree(parents[0].tolist())[0])  # [7]
    seeds = torch.arange(n)
    rows = logits.repeat(n, 1)  # [n * 7, V]
    ints = torch.stack([torch.zeros(n * 7, dtype=torch.int64), seeds.repeat_interleave(7),
                        (100 + depth).repeat(n)])
    wp = WarpParams.build([(0.8, 0, 1.0, 0.0)], CPU).repeat(n * 7)
    target = sample_keyed(rows, wp, ints).view(n, 7)
    emitted, accepted, _ = walk(target, tokens.expand(n, 6), parents.expand(n, 6), 3)
    p = torch.softmax(logits.double() / 0.8, dim=-1)  # [7, V]
    first = emitted[:, 0]

    def fits(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
        seen = torch.bincount(tokens, minlength=vocab).double()
        return chisquare(seen.numpy(), (probs * seen.sum()).numpy()).pvalue > 1e-3

    assert fits(first, p[0])
    assert (accepted > 0).float().mean() > 0.3  # the root's two likeliest tokens are its children
    for child in (0, 1):  # given the walk took child c, the next token is c's row's
        took = first == tokens[0, child]
        assert fits(emitted[took, 1], p[1 + child])
    # the same noise, position by position, as a plain step: the root's token is plain sampling's
    plain = sample_keyed(logits[:1].repeat(n, 1), WarpParams.build([(0.8, 0, 1.0, 0.0)], CPU).repeat(n),
                         torch.stack([torch.zeros(n, dtype=torch.int64), seeds, torch.full((n,), 100)]))
    assert torch.equal(first, plain)
    assert rng.TARGET  # the stream both draw from


def test_a_heads_race_picks_the_targets_draw_when_its_probabilities_are_the_targets():
    """race_logits runs the target's race (the noise keyed at the position, the temperature) over the
    head's logits: where they are the target's, the raced best is exactly what the target samples,
    where the head's own likeliest token agrees with it far less often."""
    g = torch.Generator().manual_seed(4)
    n, vocab = 400, 64
    logits = torch.randn(n, vocab, generator=g)  # flat-ish: T = 1.3 leaves many plausible tokens
    seeds, keys = torch.arange(n) * 7 + 1, torch.arange(n) + 50
    wp = WarpParams.build([(1.3, 0, 1.0, 0.0)], CPU).repeat(n)
    target = sample_keyed(logits, wp, torch.stack([torch.zeros(n, dtype=torch.int64), seeds, keys]))
    race = Race(torch.zeros(n, dtype=torch.int64), seeds, torch.full((n,), 1.3))
    assert torch.equal(race_logits(logits, race, keys).argmax(-1), target)
    assert (logits.argmax(-1) == target).float().mean() < 0.5
    greedy = Race(torch.ones(n, dtype=torch.int64), seeds, torch.zeros(n))
    assert torch.equal(race_logits(logits, greedy, keys), logits)


def test_a_sampled_tree_ranks_each_level_by_the_race_at_its_position():
    """A head whose probabilities are all but flat leaves the ranking to the noise: the best child at
    depth d is then the target's draw at position P + d (the argmin of its Exp(1) noise); a greedy
    request in the same batch keeps q's order (a slight slope: the lowest ids first)."""
    vocab, hidden, shape = 40, 8, TreeShape(4, 2, 3, 21)  # every candidate kept

    class FlatHead:
        def target_logits(self, out: torch.Tensor, upcast: bool = True) -> torch.Tensor:
            return (-1e-6 * torch.arange(vocab, dtype=torch.float32)).expand(out.shape[0], vocab)

    def layer(ids, feats, layout, rows=None):
        return torch.zeros(ids.shape[0], hidden)

    pending, seeds = torch.tensor([9, 30]), torch.tensor([5, 6])
    race = Race(torch.tensor([0, 1]), seeds, torch.tensor([0.8, 0.0]))
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    tokens, parents = grow(FlatHead(), layer, torch.zeros(2, hidden), pending, table, 16, shape, race)  # type: ignore[arg-type]
    depth = depths(parents, shape.depth)  # [2, N]
    for d in range(1, shape.depth + 1):
        noise = rng.exponentials(seeds[:1], pending[:1].view(1, 1) + d, rng.TARGET, vocab)[0, 0]  # [V]
        at = tokens[0][depth[0] == d]
        assert at[0] == noise.argmin(), d  # best first: the level's best node holds the race's winner
    assert tokens[1][depth[1] == 1].tolist() == [0, 1, 2]


def test_tree_masks_attend_to_the_context_and_each_nodes_own_path():
    """Each window row's attention equals attention over the context plus its path alone."""
    g = torch.Generator().manual_seed(1)
    heads, kvh, dim, bs = 4, 2, 8, 4
    cache_k, cache_v = torch.randn(6, bs, kvh, dim, generator=g), torch.randn(6, bs, kvh, dim, generator=g)
    parents = [ROOT, ROOT, 0, 0, 2]
    depth, bits = host_tree(parents)
    start, table = 9, [3, 0, 5, 1]  # the window: positions 9 .. 14
    q = torch.randn(6, heads, dim, generator=g)
    layout = BatchLayout.build([start], [6], [table], bs, CPU, trees=[(depth, bits)])
    assert layout.positions.tolist() == [start + d for d in depth]
    assert layout.slot_mapping.tolist() == [table[p // bs] * bs + p % bs for p in range(start, start + 6)]
    out = paged_attention(q, cache_k, cache_v, layout, 0.5)
    keys = cache_k[table].reshape(-1, kvh, dim)
    vals = cache_v[table].reshape(-1, kvh, dim)
    for r in range(6):
        seen = list(range(start)) + [start + c for c in range(6) if bits[r] >> c & 1]
        k, v = keys[seen].repeat_interleave(heads // kvh, 1), vals[seen].repeat_interleave(heads // kvh, 1)
        att = torch.softmax(torch.einsum("hd,khd->hk", q[r], k) * 0.5, dim=-1)
        assert torch.allclose(out[r], torch.einsum("hk,khd->hd", att, v), atol=1e-5)


def test_tree_verify_logits_equal_each_paths_own_forward(tiny_model_dir):
    """The target over a tree window gives at each node the logits of a causal pass over its path."""
    target = load_model(str(tiny_model_dir), CPU, torch.float32)[0]
    prompt = list(range(3, 23))
    parents = [ROOT, ROOT, ROOT, 0, 0, 1, 3, 6]
    tokens = [40, 41, 42, 50, 51, 52, 60, 70]
    depth, bits = host_tree(parents)
    cache = PagedKVCache(target.args, 8, 16, torch.float32, CPU)
    table = [4, 2, 7]
    pre = BatchLayout.build([0], [len(prompt) - 1], [table], 16, CPU)
    target(torch.tensor(prompt[:-1]), pre, cache, torch.tensor([0]))
    start = len(prompt) - 1
    layout = BatchLayout.build([start], [9], [table], 16, CPU, trees=[(depth, bits)])
    tree_logits = target(torch.tensor([prompt[-1], *tokens]), layout, cache, torch.arange(9)).logits
    for node in range(len(tokens)):
        path, up = [], node
        while up != ROOT:
            path.insert(0, tokens[up])
            up = parents[up]
        ids = prompt + path
        fresh = PagedKVCache(target.args, 4, 16, torch.float32, CPU)
        full = BatchLayout.build([0], [len(ids)], [[0, 1, 2]], 16, CPU)
        ref = target(torch.tensor(ids), full, fresh, torch.tensor([len(ids) - 1])).logits[0]
        assert torch.allclose(tree_logits[1 + node], ref, atol=1e-4), node


def test_a_chain_shaped_tree_drafts_the_chain(tiny_model_dir, head):
    """A tree of frontier 1 and branch 1 is EAGLE's greedy chain: same drafts, parents 0, 1, ..."""
    k = 4
    chain = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), num_speculative_tokens=k)
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head),
               speculative_tree=TreeShape(k, 1, 1, k))
    seen = {}
    for name, llm in (("chain", chain), ("tree", tree)):
        drafts = []
        original = llm.core.scheduler.update

        def update(plan, results, original=original, drafts=drafts):
            drafts.extend((r.draft_ids, r.draft_parents) for r in results if r.draft_ids)
            return original(plan, results)

        llm.core.scheduler.update = update  # type: ignore[method-assign]
        llm.generate(PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3)
        seen[name] = drafts
    # Near max_tokens a chain is cut to what can still be emitted, a tree stays whole.
    assert len(seen["tree"]) == len(seen["chain"])
    assert all(c == t[: len(c)] for (t, _), (c, _) in zip(seen["tree"], seen["chain"], strict=True))
    assert all(p == [ROOT, 0, 1, 2] for _, p in seen["tree"])


@pytest.mark.parametrize("shape", ["4,1,1,4", "3,2,2,6", "4,3,3,10", "5,4,5,16"])
def test_greedy_tree_speculation_is_token_identical(tiny_model_dir, head, reference, shape):
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=shape)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    stats = [r.spec_stats for r in res]
    assert sum(s.accepted for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
    _assert_free(llm)


def test_trees_beat_a_chain_of_their_depth(tiny_model_dir, head):
    """More candidates per depth: more tokens per verify step on the same head (greedy)."""
    taus = {}
    for shape in ("4,1,1,4", "4,4,4,16"):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=shape)
        res = llm.generate(PROMPTS * 2, greedy_params() * 2)
        steps, emitted = sum(r.spec_stats.steps for r in res), sum(r.spec_stats.emitted for r in res)
        taus[shape] = emitted / steps
    assert taus["4,4,4,16"] > taus["4,1,1,4"] * 1.05, taus


def test_seeded_tree_sampling_is_plain_sampling_token_for_token(tiny_model_dir, head):
    """The walk draws each token as a plain step does: seeded, the same text, top-k/top-p/min-p too."""
    plain = LLM(str(tiny_model_dir))
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=24, seed=s, ignore_eos=True)
              for s, (t, k, p, m) in enumerate([(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (0.8, 5, 1.0, 0.0),
                                                (1.0, 0, 0.8, 0.0), (1.2, 0, 1.0, 0.1), (0.0, 0, 1.0, 0.0)])]
    a, b = plain.generate(PROMPTS, params), tree.generate(PROMPTS, params)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    assert sum(r.spec_stats.accepted for r in b) > 0
    _assert_free(tree)


def test_penalised_trees_and_chains_are_plain_decoding_token_for_token(tiny_model_dir, head):
    """Logit bias and penalties through an EAGLE head's trees (each row counting the drafts on its own
    path) and its chain: greedy answers are plain decoding's, and a tree's seeded sampled ones too; the
    chain's steps queued ahead (pipeline) serve the unpenalised requests of the same batch."""
    from tests.engine.test_penalties import BIAS

    # Penalties that reward repeating: what a row counts (its own path's drafts) moves its argmax.
    penalties = dict(frequency_penalty=-1.0, presence_penalty=-0.5, repetition_penalty=0.8, logit_bias=BIAS)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **penalties) for n in MAX_TOKENS]
    sampled = [SamplingParams(temperature=t, top_k=k, max_tokens=24, seed=s, ignore_eos=True, **penalties)
               for s, (t, k) in enumerate([(1.0, 0), (0.7, 0), (0.8, 5), (1.2, 0), (0.5, 0), (1.0, 0)])]
    plain = LLM(str(tiny_model_dir))
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS * 2, greedy + sampled)]
    assert want[:6] != [r.outputs[0].token_ids for r in plain.generate(PROMPTS, greedy_params())]
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10")
    res = tree.generate(PROMPTS * 2, greedy + sampled)
    assert [r.outputs[0].token_ids for r in res] == want
    assert sum(r.spec_stats.accepted for r in res) > 0
    _assert_free(tree)
    longer = [SamplingParams(temperature=0.0, max_tokens=n + 24, ignore_eos=True) for n in MAX_TOKENS]
    unpenalised = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, longer)]
    chain = _chained_engine(tiny_model_dir, head, pipeline=True)  # the head queued behind the verify, as on CUDA
    res = chain.generate(PROMPTS * 2, greedy + longer)
    assert [r.outputs[0].token_ids for r in res] == want[:6] + unpenalised
    assert sum(r.spec_stats.accepted for r in res[:6]) > 0
    assert chain.core.rt.worker.lookahead.taken > 0  # once the penalised requests are done
    _assert_free(chain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_penalised_requests_verify_eagerly_beside_graphs(tiny_model_dir, head):
    """On CUDA a penalised request's steps leave the graphs' greedy verify and tree steps and the steps
    queued ahead: its answers are plain decoding's, through the Triton samplers over its float32
    penalised logits, and the unpenalised requests of the batch keep the graphs."""
    from tests.engine.test_penalties import BIAS

    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=8192)
    penalties = dict(frequency_penalty=-1.0, presence_penalty=-0.5, repetition_penalty=0.8, logit_bias=BIAS)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **penalties) for n in MAX_TOKENS]
    sampled = [SamplingParams(temperature=t, max_tokens=20, seed=s, ignore_eos=True, **penalties)
               for s, t in enumerate([1.0, 0.7, 1.2])]
    longer = [SamplingParams(temperature=0.0, max_tokens=n + 24, ignore_eos=True) for n in MAX_TOKENS]
    plain = LLM(str(tiny_model_dir), **kw)
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS * 2 + PROMPTS[:3], greedy + longer + sampled)]
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10", **kw)
    assert [r.outputs[0].token_ids for r in tree.generate(PROMPTS * 2 + PROMPTS[:3], greedy + longer + sampled)] == want
    assert tree.core.rt.worker.tree_graphs.replays > 0
    _assert_free(tree)
    chain = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), num_speculative_tokens=4, **kw)
    assert [r.outputs[0].token_ids for r in chain.generate(PROMPTS * 2, greedy + longer)] == want[:12]
    assert chain.core.rt.worker.lookahead.taken > 0 and chain.core.rt.worker.verifier.graph_greedy > 0
    _assert_free(chain)


def test_end_to_end_tree_sampling_matches_target_distribution(tiny_model_dir, head):
    n, temperature = 2000, 1.0
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="3,3,3,8",
              max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.encode_prompt("Once upon a time")
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=s + 10_000, ignore_eos=True) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, 0, 1.0, 0.0))
    _assert_free(llm)


def test_trees_under_preemption_stops_and_logprobs(tiny_model_dir, head, reference):
    """A pool too small for every request (preemption by recompute), min_tokens, stop ids and
    log-probabilities through tree steps: exact, and nothing leaks."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              kv_cache_tokens=160)
    sched = llm.core.scheduler
    preempted = []
    original = sched._preempt
    sched._preempt = lambda r: (preempted.append(list(r.draft_parents)), original(r))  # type: ignore[method-assign]
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    assert preempted and any(preempted), "no request was preempted holding a tree"
    plain = LLM(str(tiny_model_dir))
    eos = llm.core.rt.eos_ids
    params = [SamplingParams(temperature=0.9, max_tokens=16, min_tokens=10, seed=4, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[reference[0][5]], logprobs=1)]
    a, b = plain.generate(PROMPTS[:2], params), llm.generate(PROMPTS[:2], params)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.outputs[0].logprobs) == len(y.outputs[0].token_ids)
        assert np.allclose(x.outputs[0].logprobs, y.outputs[0].logprobs, atol=1e-4)
    assert not set(b[0].outputs[0].token_ids[:10]) & set(eos)
    _assert_free(llm)


CUDA_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("device", "pipeline"), [("cpu", False), ("cpu", True),
                                                  pytest.param("cuda", None, marks=CUDA_ONLY)])
def test_trees_gated_by_the_batch_switch_with_plain_steps_exactly(tiny_model_dir, head, device, pipeline):
    """speculative_max_batch=2: six requests decode plain steps (their first trees are dropped), then the
    last two catch their heads up from the stream store and draft trees. Greedy and seeded answers equal
    plain decoding's; with steps queued ahead (pipeline; on CUDA with tree graphs) the switches take the
    held step; nothing leaks."""
    kw = dict(device=device, pipeline=pipeline, dtype="float32", kv_cache_tokens=8192)
    plain = LLM(str(tiny_model_dir), **kw)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              speculative_max_batch=2, **kw)
    if device == "cuda":  # graphs for the buckets a tree step can fill, no more
        assert sorted({b for b, _ in llm.core.rt.worker.tree_graphs.graphs}) == [1, 2]
    policy = llm.core.scheduler.policy
    gates: list[bool] = []
    choose = policy.choose

    def record(*args):
        decision = choose(*args)
        gates.append(policy.speculating)
        return decision

    policy.choose = record  # type: ignore[method-assign]
    sampled = [SamplingParams(temperature=0.9, max_tokens=n, seed=7 + n, ignore_eos=True) for n in MAX_TOKENS]
    for params in (greedy_params(), sampled):
        gates.clear()
        a, b = plain.generate(PROMPTS, params), llm.generate(PROMPTS, params)
        assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
        plain_then_tree = [i for i in range(1, len(gates)) if gates[i] and not gates[i - 1]]
        assert False in gates and plain_then_tree, gates
        longest = [r for r, n in zip(b, MAX_TOKENS, strict=True) if n >= 24]
        assert all(r.spec_stats.drafted > 0 for r in longest) and sum(r.spec_stats.accepted for r in longest) > 0
        # answers that end while three or more decode verify no drafts: their trees were dropped
        assert all(r.spec_stats.drafted == 0 for r, n in zip(b, MAX_TOKENS, strict=True) if n <= 17)
    if device == "cuda":
        assert llm.core.rt.worker.tree_graphs.replays > 0
    _assert_free(llm)
    with pytest.raises(ValueError, match="adaptive"):
        SpecConfig(method="eagle", max_batch=2, policy="adaptive")


def test_gated_trees_under_aborts_free_everything(tiny_model_dir, head):
    """Aborts in both regimes of a gated tree engine with steps queued ahead: among eight decoding plain
    steps, then down to two drafting trees, then one of those two mid-tree. The survivor's seeded answer
    is plain decoding's; every block, q slot and tracker is freed."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
              speculative_max_batch=2, pipeline=True, kv_cache_tokens=2048)
    core, ids = llm.core, [f"r{i}" for i in range(12)]
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True) for i in range(12)]
    for rid, prompt, sp in zip(ids, PROMPTS * 2, params, strict=True):
        core.add_request(rid, core.encode_prompt(prompt), sp)
    aborts = {3: ids[:4], 10: ids[4:10], 16: ids[10:11]}
    finished: dict[str, str] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    steps, gates = 0, []
    while core.has_work:
        steps += 1
        for rid in aborts.get(steps, []):
            core.abort(rid)
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
        gates.append(core.scheduler.policy.speculating)
    assert sorted(finished) == sorted(ids)
    assert {finished[r] for r in ids[:11]} == {"cancelled"} and finished["r11"] == "length"
    assert False in gates[:10] and all(gates[12:16]), gates
    plain = LLM(str(tiny_model_dir)).generate([PROMPTS[5]], [params[11]])[0]
    assert tokens["r11"] == plain.outputs[0].token_ids
    _assert_free(llm)


def test_tree_shapes_and_settings_are_checked():
    assert TreeShape.parse("6,6,6,31") == TreeShape(6, 6, 6, 31)
    for bad in ("6,6,6", "6,7,6,31", "6,6,6,70", "2,2,2,9", "6,8,8,20", "x"):
        with pytest.raises(ValueError):
            TreeShape.parse(bad)
    with pytest.raises(ValueError, match="EAGLE"):
        SpecConfig(method="ngram", tree=TreeShape(), num_tokens=31)
    assert SpecConfig(method="eagle", tree=TreeShape(), num_tokens=31, policy="adaptive").policy == "adaptive"
    with pytest.raises(ValueError, match="fixed policy"):
        SpecConfig(method="eagle", tree=TreeShape(), num_tokens=31, policy="adaptive", max_batch=4)
    with pytest.raises(ValueError, match="31 nodes"):
        SpecConfig(method="eagle", tree=TreeShape(), num_tokens=4)


@pytest.mark.parametrize(("temperature", "shape", "cut"), [(0.0, "4,3,3,10", {}), (0.9, "4,3,3,10", {}),
                                                           (0.9, "3,8,8,24", {}),
                                                           (0.9, "4,3,3,10", dict(top_p=0.8, top_k=20))])
def test_tree_graph_steps_queued_ahead_change_nothing(tiny_model_dir, head, temperature, shape, cut):
    """The work of a tree graph (worker/tree_graphs.py: verify, walk, moves, catch-up, growth, the next
    replay's inputs), run eagerly on the CPU with steps queued ahead: the same text as plain decoding,
    and steps queued ahead are taken; requests cut by top-k/top-p replay the sorted race's graph."""
    from streamsd.worker.tree_graphs import CUT, SAMPLED, tree_graphs_for

    plain = LLM(str(tiny_model_dir))
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree=shape,
              pipeline=True)
    rt, w = llm.core.rt, llm.core.rt.worker
    w.tree_graphs = tree_graphs_for(w, w.proposer, rt.scheduler_config.num_blocks, rt.scheduler_config.max_model_len)
    params = [SamplingParams(temperature=temperature, max_tokens=40, seed=s, ignore_eos=True, **cut) for s in range(4)]
    a, b = plain.generate(PROMPTS[:4], params), llm.generate(PROMPTS[:4], params)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    mode = CUT if cut else SAMPLED
    # One request of the batch stops early (a stop id its plain answer reaches at token 12): the
    # queued step then lost a row, and the rows after it must still be their own requests'.
    stop = a[1].outputs[0].token_ids[12]
    params[1] = SamplingParams(temperature=temperature, max_tokens=40, seed=1, ignore_eos=True, stop_token_ids=[stop],
                               **cut)
    a, b = plain.generate(PROMPTS[:4], params), llm.generate(PROMPTS[:4], params)
    assert len(a[1].outputs[0].token_ids) <= 13
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    if temperature > 0:  # the last steps ran 3 requests in bucket 4: the padding row is greedy, never raced
        assert {m for _, m in w.tree_graphs.graphs} == {mode}
        g, width = w.tree_graphs.graphs[(4, mode)], w.tree_graphs.width
        assert g.draws[0, 3].item() == 1 and bool((g.row_ints[0, 3 * width :] == 1).all())
        assert g.warp_f[0, 3].item() == 1.0
        if cut:  # the requests' cut on their rows, none on the padding row's
            assert bool((g.row_top_p[: 3 * width] == 0.8).all()) and bool((g.row_top_k[: 3 * width] == 20).all())
            assert bool((g.row_top_p[3 * width :] == 1.0).all()) and bool((g.row_top_k[3 * width :] == 0).all())
    assert w.tree_graphs.replays > 0 and w.lookahead.taken > 0
    assert sum(r.spec_stats.accepted for r in b) > 0
    _assert_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", ["4,3,3,10", "3,8,8,24", "4,6,6,24"])
def test_cuda_tree_steps_through_graphs_equal_the_eager_engine(tiny_model_dir, head, shape):
    """On CUDA whole tree steps are graph replays queued one ahead (worker/tree_graphs.py): greedy and
    seeded answers (top-k/top-p ones through the sorted race's graph) equal plain decoding's, batch 1 and
    4, and nothing is captured or compiled once the engine is built."""
    from streamsd.kernels.warmup import compiled_by_kernel

    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), device="cuda",
              dtype="float32", kv_cache_tokens=8192, max_num_seqs=4, speculative_tree=shape)
    w = llm.core.rt.worker
    assert w.tree_graphs is not None and w.tree_graphs.graphs
    before = (len(w.tree_graphs.graphs), compiled_by_kernel())
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, min_p=0.05),
             dict(temperature=0.9, top_k=20, top_p=0.8)]
    for i, kw in enumerate(kinds):
        params = [SamplingParams(max_tokens=60, seed=10 * i + j, ignore_eos=True, **kw) for j in range(4)]
        for batch in (PROMPTS[i : i + 1], PROMPTS[:4]):
            a, b = plain.generate(batch, params[: len(batch)]), llm.generate(batch, params[: len(batch)])
            assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b], kw
    assert w.tree_graphs.replays > 20 and w.lookahead.taken > 10, (w.tree_graphs.replays, w.lookahead.taken)
    # A model's generation config gives top-k/top-p to requests that leave them out: an argmax ignores them.
    replays, cut = w.tree_graphs.replays, [SamplingParams(max_tokens=60, temperature=0.0, top_p=0.9, top_k=40)] * 2
    a, b = plain.generate(PROMPTS[:2], cut), llm.generate(PROMPTS[:2], cut)
    assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
    assert w.tree_graphs.replays > replays + 10
    graphs, compiled = before
    after = compiled_by_kernel()
    assert len(w.tree_graphs.graphs) == graphs
    assert after == compiled, {k: after[k] - compiled[k] for k in after if after[k] != compiled[k]}
    _assert_free(llm)


def test_tree_graph_modes_follow_the_batch_sampling():
    """Greedy batches replay the argmax graph whatever their top-k/top-p (a cut changes nothing of an
    argmax); sampled ones the one-launch race, or the sorted race once any sampled request is cut;
    penalised requests take the eager path."""
    from streamsd.worker.tree_graphs import CUT, GREEDY, SAMPLED, mode_for, replayable

    greedy_cut = SamplingParams(temperature=0.0, top_p=0.9, top_k=40)
    uncut, cut_p, cut_k = (SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.0, top_p=0.9),
                           SamplingParams(temperature=0.7, top_k=20))
    assert all(replayable(p) for p in (greedy_cut, uncut, cut_p, cut_k))
    assert not replayable(SamplingParams(temperature=0.0, repetition_penalty=1.2))
    assert mode_for([greedy_cut, greedy_cut]) == GREEDY
    assert mode_for([greedy_cut, uncut]) == SAMPLED
    assert mode_for([uncut, cut_p]) == mode_for([cut_k]) == mode_for([greedy_cut, cut_k]) == CUT


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_trees_grown_through_grow_graphs_equal_eager_ones(tiny_model_dir, head, temperature):
    """The growths the proposer runs itself (a request's first tree, after its prompt) through the grow
    graphs' static buffers (spec_decode/eagle/grow_graphs.py; captured on CUDA, run as is on a CPU): at batch 1 the
    prompt's catch-up too. The same trees as eager catch-ups and growths, so the same drafts accepted
    step by step, at batch 1 and 3 (a padded bucket)."""
    from streamsd.spec_decode.eagle.grow_graphs import GrowGraphs

    cuda = torch.cuda.is_available()
    engines = [LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10",
                   device="cuda" if cuda else "cpu", dtype="float32", max_num_seqs=4, kv_cache_tokens=4096)
               for _ in range(2)]
    engines[0].core.rt.worker.proposer.grow_graphs = None  # eager growths
    p = engines[1].core.rt.worker.proposer
    if cuda:  # captured with the engine
        assert p.grow_graphs is not None and p.grow_graphs.graphs
        p.grow_graphs.graphs.clear()  # captured again on first use: the keys this test replays
    else:
        p.grow_graphs = GrowGraphs(p.head, p._run, p.tree, p.cache.block_size, 16, engines[1].core.rt
                                   .scheduler_config.num_blocks, torch.float32, p.device, p.store, (32, 64))
    for batch in (PROMPTS[:1], PROMPTS[1:4]):
        params = [SamplingParams(temperature=temperature, max_tokens=24, seed=s, ignore_eos=True) for s in range(3)]
        a, b = (llm.generate(batch, params[: len(batch)]) for llm in engines)
        assert [r.outputs[0].token_ids for r in a] == [r.outputs[0].token_ids for r in b]
        assert [(r.spec_stats.steps, r.spec_stats.accepted) for r in a] == \
            [(r.spec_stats.steps, r.spec_stats.accepted) for r in b]
    keys = set(p.grow_graphs.graphs)
    # batch 1: a catch-up (the prompt's, on a CPU every step's) and its growth in one replay; batch 3: growths
    assert p.grow_graphs.replays >= 2 and {(1, temperature > 0, 32), (4, temperature > 0, 0)} <= keys
    assert all(sampled == (temperature > 0) for _, sampled, _ in keys)
    _assert_free(engines[1])


def test_cli_generates_with_a_tree_and_refuses_a_bad_one(tiny_model_dir, head, reference, capsys):
    from streamsd.cli import main

    args = ["generate", "--model", str(tiny_model_dir), "--draft-model", str(head), "--speculative-method", "eagle",
            "--max-tokens", str(MAX_TOKENS[0]), "--prompt", PROMPTS[0]]
    # The fixed policy: a tree every step. (The default, the step chooser, decides by this CPU's costs.)
    assert main([*args, "--speculative-tree", "4,3,3,10", "--speculation-policy", "fixed"]) == 0
    tree = capsys.readouterr().out
    assert main([*args, "--speculative-tree", "4,3,3,10"]) == 0
    chosen = capsys.readouterr().out
    assert main(["generate", "--model", str(tiny_model_dir), "--max-tokens", str(MAX_TOKENS[0]),
                 "--prompt", PROMPTS[0]]) == 0
    plain = capsys.readouterr().out
    assert "(eagle)" in tree and "mean accepted length" in tree
    # greedy: the same text as plain decoding, whichever steps the chooser took
    assert tree.splitlines()[0] == chosen.splitlines()[0] == plain.splitlines()[0]
    assert main([*args, "--speculative-tree", "4,3,3,70"]) == 2
    assert "nodes" in capsys.readouterr().err
    assert main([*args[:6], "ngram", *args[7:], "--speculative-tree", "4,3,3,10"]) == 2
    assert "EAGLE" in capsys.readouterr().err


def test_constrained_requests_take_plain_steps_beside_trees_with_plain_decodings_answers(tiny_model_dir, head):
    """A grammar's mask would need each tree node's own path state: a constrained request is decoded
    one token a step (no drafts) while the others of its batch keep their trees; its answers, greedy
    and seeded, are plain constrained decoding's."""
    from streamsd.request import Constraint

    pattern = Constraint("regex", "(The|Once|[a-z ]{1,12})[ a-z0-9.,]{0,40}", "guided_regex")
    params = [SamplingParams(temperature=0.0, max_tokens=30, constraint=pattern),
              SamplingParams(temperature=1.0, max_tokens=30, seed=5, constraint=pattern),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    plain = LLM(str(tiny_model_dir))
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS[:3], params)]
    tree = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(head), speculative_tree="4,3,3,10")
    res = tree.generate(PROMPTS[:3], params)
    assert [r.outputs[0].token_ids for r in res] == want
    assert [r.spec_stats.drafted for r in res][:2] == [0, 0] and res[2].spec_stats.drafted > 0
    _assert_free(tree)
