"""Draft trees' pieces (spec_decode/tree.py, eagle/tree.py, sample/tree_verify.py): masks, walk, race."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from streamsd.config import SpecConfig, TreeShape
from streamsd.model.attention import paged_attention
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.loader import load_model
from streamsd.model.tree_layout import NONE, ROOT, Race
from streamsd.sample import rng
from streamsd.sample.sampler import sample_keyed
from streamsd.sample.tree_verify import host_tree
from streamsd.sample.warp import WarpParams
from streamsd.spec_decode.eagle.tree import grow, race_logits
from streamsd.spec_decode.tree import ancestor_bits, depths, path_moves, select, walk, window_bits
from tests.spec_decode.eagle_helpers import CPU

# A tree over nodes 0..5: the root's children 0 (token 5) and 1 (7); 0's children 2 (9) and 3 (4);
# 2's child 4 (1); node 5 is padding.
PARENTS = torch.tensor([[ROOT, ROOT, 0, 0, 2, NONE]])
TOKENS = torch.tensor([[5, 7, 9, 4, 1, 0]])


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
