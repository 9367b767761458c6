"""The draft-tree kernels (kernels/tree/) against their torch oracles: top-k, bookkeeping, select, grow."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV  # isort: skip (first: it sets the interpreter up)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_int8_head_topk_equals_its_torch_oracle(draft_vocab):
    """kernels/tree/head_topk.py: the head's final norm, an int8 lm_head (a scale per id) and the k best
    log-probabilities in one pass give what torch gives over the dequantized rows: greedy rows and raced ones (the target's noise at each request's key, over target ids where
    the head has a draft vocabulary), a vocabulary and a width that are no multiple of the blocks, a
    padding row of NaN."""
    from streamsd.kernels.tree.head_topk import DraftLogits, head_topk
    from streamsd.model.tree_layout import Race
    from streamsd.spec_decode.eagle.tree import race_logits

    g = torch.Generator().manual_seed(5)
    vocab, hidden, k, eps = 1000, 96, 4, 1e-5
    d2t = None
    ids = torch.arange(vocab)
    if draft_vocab:  # 600 target ids, ascending: draft id d is target id d + d2t[d]
        ids = torch.randperm(vocab, generator=g)[:600].sort().values
        d2t = (ids - torch.arange(600)).to(DEV)
    w = torch.randn(ids.numel(), hidden, generator=g) * 0.05
    norm = 1 + 0.1 * torch.randn(hidden, generator=g)
    lm_head = w.to(DEV)
    head = DraftLogits.build(lm_head, norm.to(DEV), eps, d2t)
    assert torch.equal(lm_head.cpu(), w)  # the target's own lm_head (float32 here) is left as it was
    rows = head.dequantized().cpu()  # [V', H]
    err = (rows - w).abs()
    assert (err <= head.scale.cpu().unsqueeze(1) / 2 + 1e-6).all() and err.max() > 0
    out = torch.randn(8, hidden, generator=g).to(torch.bfloat16)
    race = Race(torch.tensor([0, 1, 0, 0]), torch.tensor([7, 8, 2**40 + 9, 0]), torch.tensor([1.0, 0.0, 0.6, 0.0]))
    keys = torch.tensor([31, 5, 1000, 3])

    def oracle(r: Race | None, keys: torch.Tensor = keys) -> tuple[torch.Tensor, torch.Tensor]:
        x = out.float()
        normed = (x * norm).to(torch.bfloat16).float() * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        logits = torch.full((8, vocab), float("-inf")).index_copy_(1, ids, normed @ rows.t())
        if r is not None:
            logits = race_logits(logits, r, keys)
        return torch.log_softmax(logits, -1).topk(k, -1)

    # 4 requests of 2 rows, then 1 of 8 (a block of rows of one request: one row of noise serves them all)
    one, one_key = Race(torch.tensor([0]), torch.tensor([2**33 + 5]), torch.tensor([0.8])), torch.tensor([78])
    for r, at in ((None, keys), (race, keys), (one, one_key)):
        on_dev = None if r is None else Race(r.greedy.to(DEV), r.seeds.to(DEV), r.temperature.to(DEV))
        v, i = head_topk(out.to(DEV), head, k, on_dev, at.to(DEV))
        ref_v, ref_i = oracle(r, at)
        assert torch.equal(i.cpu(), ref_i), (v[0], ref_v[0])
        assert torch.allclose(v.cpu(), ref_v, atol=2e-2)
    many = head_topk(out.repeat(5, 1).to(DEV), head, k)  # 40 rows: the tiling for more than one block of rows
    assert torch.equal(many[1].cpu(), oracle(None)[1].repeat(5, 1))
    # All k best of a row in one block of ids (the merge re-ranks the k blocks with the best bests)
    w[3 : 3 + k] = out[0].float() * torch.linspace(1.0, 0.5, k).unsqueeze(1) / out[0].float().norm()
    head = DraftLogits.build(w.to(DEV), norm.to(DEV), eps, d2t)
    rows = head.dequantized().cpu()
    v, i = head_topk(out.to(DEV), head, k)
    assert torch.equal(i.cpu(), oracle(None)[1]) and set(i[0].tolist()) == set(ids[3 : 3 + k].tolist())
    if not CUDA:  # NumPy's argmax refuses an all-NaN row; a graph's padding rows meet NaN on CUDA only
        return
    garbage = torch.full((3, hidden), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert ((head_topk(garbage, head, k)[1].cpu().unsqueeze(-1) == ids).any(-1)).all()  # ids of the vocabulary


def test_tree_bookkeeping_kernels_equal_the_torch_oracles():
    """kernels/tree/bookkeeping.py against spec_decode/tree.py: the walk (and the head's catch-up laid out after it), the
    accepted nodes' moves (all read before any is written) and the next step's ids, positions, slots and masks, roots, tree and result."""
    from streamsd.kernels.tree import bookkeeping as kt
    from streamsd.sample.tree_verify import host_tree
    from streamsd.spec_decode import tree as st

    g = torch.Generator().manual_seed(5)
    b, n, d, bs = 3, 10, 4, 4
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1, 3, 3, 6, -2],
                            [-1, 0, 1, 2, -1, 4, 5, -2, -2, -2],
                            [-1, -1, 1, 1, 2, -1, 4, 5, 3, 0]])  # depth <= 4
    tokens = torch.randint(0, 6, (b, n), generator=g)
    for row in range(b):  # siblings hold distinct tokens
        for i in range(n):
            sib = [tokens[row, j].item() for j in range(i) if parents[row, j] == parents[row, i]]
            while tokens[row, i].item() in sib:
                tokens[row, i] = (tokens[row, i] + 1) % 50
    for trial in range(20):
        target = torch.randint(0, 6, (b, n + 1), generator=g)
        if trial % 2:  # a walk down a long path
            target[:, 0] = tokens[:, 0]
            target[:, 1] = torch.where(parents[:, 3] == 0, tokens[:, 3], target[:, 1])
        ref = st.walk(target, tokens, parents, d)
        *out, none = kt.walk(target.to(DEV), tokens.to(DEV), parents.to(DEV), d)
        assert none is None and all(torch.equal(x.cpu(), y) for x, y in zip(out, ref, strict=True)), trial
        # with the windows' roots and blocks, the head's catch-up after the walk in the same launch
        roots, table = torch.tensor([2, 13, 0]), torch.tensor([[3, 1, 4, 0, 9], [2, 6, 5, 7, 10], [8, 11, 12, 14, 15]],
                                                                dtype=torch.int32)
        *out, laid = kt.walk(target.to(DEV), tokens.to(DEV), parents.to(DEV), d, roots.to(DEV), table.to(DEV), bs)
        assert all(torch.equal(x.cpu(), y) for x, y in zip(out, ref, strict=True)), trial
        want = st.catch_up(roots, ref[1], ref[0], table, bs)
        assert all(x.dtype == y.dtype and torch.equal(x.cpu(), y) for x, y in zip(laid, want, strict=True)), trial
    # moves: one cache plane of 8 slots a block, path nodes anywhere in the window
    table = torch.tensor([[3, 1, 4, 0], [2, 6, 5, 7], [8, 9, 10, 11]], dtype=torch.int32)
    roots = torch.tensor([2, 5, 1])
    path = torch.tensor([[2, 5, -1, -1], [0, 1, 2, 3], [1, -1, -1, -1]])
    data = torch.randn(2, 12 * bs, 6, generator=g)
    ref = data.clone()
    src, dst = st.path_moves(roots, path)
    s_slot, d_slot = (st.positions_to_slots(x, table, bs).view(-1) for x in (src, dst))
    ref[:, d_slot] = ref[:, s_slot]
    moved = data.to(DEV)
    kt.move_path(moved, roots.to(DEV), path.to(DEV), table.to(DEV), bs)
    assert torch.equal(moved.cpu(), ref)
    # with a second store of other widths (the streams beside the KV cache) in the same launch
    streams = torch.randn(1, 12 * bs, 11, generator=g)
    ref_streams = streams.clone()
    ref_streams[:, d_slot] = ref_streams[:, s_slot]
    moved, moved_streams = data.to(DEV), streams.to(DEV)
    kt.move_path(moved, roots.to(DEV), path.to(DEV), table.to(DEV), bs, moved_streams)
    assert torch.equal(moved.cpu(), ref) and torch.equal(moved_streams.cpu(), ref_streams)
    # the next step: its window, roots and tree, and this step's result
    emitted = torch.tensor([[7, -1, -1, -1, -1], [4, 5, 8, -1, -1], [1, 2, 3, 4, 9]])
    accepted, pending = torch.tensor([0, 2, 4]), torch.tensor([3, 0, 6])
    first = emitted.gather(1, accepted.unsqueeze(1)).squeeze(1)  # the bonus tokens 7, 8, 9
    packed, bits = torch.zeros(3 * b * (n + 1) + 2 * b + 1, dtype=torch.int64).to(DEV), torch.zeros(b * (n + 1),
                                                                                                dtype=torch.int64).to(DEV)
    roots, tree = torch.zeros(b, dtype=torch.int64).to(DEV), torch.zeros(b, 2 * n, dtype=torch.int64).to(DEV)
    big = torch.tensor([list(range(12, 20)), list(range(20, 28)), list(range(28, 36))], dtype=torch.int32)
    result = kt.next_step(emitted.to(DEV), accepted.to(DEV), tokens.to(DEV), parents.to(DEV), pending.to(DEV),
                          big.to(DEV), bs, packed, bits, roots, tree, d)
    assert torch.equal(result.cpu(), torch.cat([emitted, accepted.unsqueeze(1), tokens, parents], dim=1))
    assert torch.equal(roots.cpu(), pending) and torch.equal(tree.cpu(), torch.cat([tokens, parents], dim=1))
    t = b * (n + 1)
    packed, bits = packed.cpu(), bits.cpu()
    for row in range(b):
        depth, mask = host_tree([p for p in parents[row].tolist() if p != -2])
        live = len(depth)
        w = slice(row * (n + 1), row * (n + 1) + live)
        assert packed[w].tolist() == [first[row].item(), *tokens[row, : live - 1].tolist()]
        assert packed[t:][w].tolist() == [pending[row].item() + x for x in depth]
        assert bits[w].tolist() == mask
        pos = pending[row] + torch.arange(n + 1)
        assert packed[2 * t + row * (n + 1) : 2 * t + (row + 1) * (n + 1)].tolist() == \
            st.positions_to_slots(pos.unsqueeze(0), big[row : row + 1], bs)[0].tolist()
        assert packed[3 * t + row] == pending[row] + n + 1
    assert torch.equal(bits.view(b, n + 1), st.window_bits(parents, d))


def test_tree_kv_moves_equal_the_torch_move_kv():
    """kernels/tree/bookkeeping.move_kv moves what sample/tree_verify.move_kv's torch path moves: every
    layer's K and V and the head's streams of the accepted nodes, from their window rows to their
    positions (all read before any is written); nothing else changes."""
    from streamsd.kernels.tree import bookkeeping as kernel
    from streamsd.model.arch import ModelArgs
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.stream_store import StreamStore
    from streamsd.sample.tree_verify import move_kv

    g = torch.Generator().manual_seed(7)
    bs = 4
    args = ModelArgs("llama", 10, 8, 16, 2, 2, 1, 4, 1e-5, 64, False, False, (), None)
    table = torch.tensor([[3, 1, 4, 0], [2, 6, 5, 7], [8, 9, 10, 11]], dtype=torch.int32)
    roots = torch.tensor([2, 5, 1])
    path = torch.tensor([[2, 5, -1, -1], [0, 1, 2, 3], [1, -1, -1, -1]])
    data, streams = torch.randn(2, 2, 12, bs, 1, 4, generator=g), torch.randn(12 * bs, 6, generator=g)
    moved = []
    for on_device in (False, True):
        dev = DEV if on_device else torch.device("cpu")
        cache, store = PagedKVCache(args, 12, bs, torch.float32, dev), StreamStore((0,), 6, 12 * bs, torch.float32, dev)
        cache.data.copy_(data)
        store.data.copy_(streams)
        move = kernel.move_kv if on_device else move_kv  # on a CPU move_kv takes its torch path
        move(cache, store, roots.to(dev), path.to(dev), table.to(dev), bs)
        moved.append((cache.data.cpu(), store.data.cpu()))
    (want_kv, want_streams), (got_kv, got_streams) = moved
    assert not torch.equal(want_kv, data) and not torch.equal(want_streams, streams)
    assert torch.equal(got_kv, want_kv) and torch.equal(got_streams, want_streams)


def test_tree_step_kernels_equal_the_torch_oracles():
    """kernels/tree/select.py against spec_decode/tree.py: the selection of a grown tree's best nodes over 114
    candidates (four blocks of the kernel's ranking) with many tied scores, whose ties the stable sort
    breaks by index."""
    from streamsd.kernels.tree import select as ks
    from streamsd.spec_decode import tree as st

    g = torch.Generator().manual_seed(11)
    b, c, n = 3, 114, 24
    parents = torch.full((b, c), st.ROOT)
    scores = torch.zeros(b, c)
    for row in range(b):
        scores[row, :6] = -torch.rand(6, generator=g)
        for i in range(6, c):
            parents[row, i] = torch.randint(0, i, (1,), generator=g)
            scores[row, i] = scores[row, parents[row, i]] - torch.rand(1, generator=g).item()
    scores = (scores * 4).round() / 4  # ties everywhere, a child never above its parent
    tokens = torch.randint(0, 1000, (b, c), generator=g)
    want_tok, want_par, _ = st.select(scores, tokens, parents, n)
    got_tok, got_par = ks.select(scores.to(DEV), tokens.to(DEV), parents.to(DEV), n)
    assert torch.equal(got_tok.cpu(), want_tok) and torch.equal(got_par.cpu(), want_par)
    # a real tree (every kept node's parent kept), deeper than one level, and ties among the kept
    assert (want_par != st.NONE).all() and (want_par >= 0).any()
    assert any(len(set(r.tolist())) < n for r in st.select(scores, tokens, parents, n)[2])
    # NaN scores (a padding row reads streams never written): every node still written, parents in range
    scores[1, ::3] = float("nan")
    scores[2] = float("nan")
    tokens[1] = torch.arange(c)  # distinct: n distinct tokens out = n nodes written
    tokens[2] = torch.arange(c)
    got_tok, got_par = (x.cpu() for x in ks.select(scores.to(DEV), tokens.to(DEV), parents.to(DEV), n))
    assert torch.equal(got_tok[0], want_tok[0]) and torch.equal(got_par[0], want_par[0])
    for row in (1, 2):
        assert len(set(got_tok[row].tolist())) == n and ((got_tok[row] >= 0) & (got_tok[row] < c)).all()
        assert ((got_par[row] >= st.NONE) & (got_par[row] < n)).all()


def test_tree_growth_levels_equal_the_torch_oracle():
    """kernels/tree/grow.py against spec/eagle_tree.expand_level over a whole growth (depth 4, frontier
    3, branch 4, two requests): the candidates written level by level, and each frontier's tokens,
    scores, candidate indices, feature rows, masks, positions, slots and context lengths."""
    from streamsd.kernels.tree import grow as kg
    from streamsd.spec_decode.eagle import tree as et

    g = torch.Generator().manual_seed(9)
    b, m, c, depth, bs = 2, 3, 4, 4, 4
    pending = torch.tensor([5, 13])
    table = torch.tensor([[3, 1, 4, 0, 9, 8], [2, 6, 5, 7, 10, 11]], dtype=torch.int32)
    total = c + (depth - 1) * m * c
    ref_c, out_c = et.Candidates.empty(b, total, torch.device("cpu")), et.Candidates.empty(b, total, DEV)
    ref_base, out_base = et.Frontier.root(b, torch.device("cpu")), et.Frontier.root(b, DEV)
    offset = 0
    for level in range(1, depth + 1):
        rows = b * ref_base.scores.shape[1]
        s = torch.log_softmax(torch.randn(rows, 50, generator=g), -1).topk(c, -1).values  # distinct scores
        t = torch.randint(0, 1000, (rows, c), generator=g)
        expand = m if level < depth else 0
        ref = et.expand_level(s, t, ref_base, offset, ref_c, expand, level, pending, table, bs)
        out = kg.expand_level(s.to(DEV), t.to(DEV), out_base, offset, out_c, expand, level, pending.to(DEV),
                              table.to(DEV), bs)
        offset += rows // b * c
        if ref is None:
            assert out is None
            break
        assert out is not None
        for name in ("tokens", "index", "rows", "bits", "positions", "slots", "context_lens"):
            assert torch.equal(getattr(out, name).cpu(), getattr(ref, name)), (level, name)
        assert torch.allclose(out.scores.cpu(), ref.scores), level
        ref_base, out_base = ref, out
    assert offset == total
    assert torch.equal(out_c.tokens.cpu(), ref_c.tokens) and torch.equal(out_c.parents.cpu(), ref_c.parents)
    assert torch.allclose(out_c.scores.cpu(), ref_c.scores)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's argmax is numpy's: NaN wins there")
def test_tree_growth_of_garbage_rows_stays_in_range():
    """A CUDA graph's padding rows grow trees from garbage: NaN scores must still name candidates and
    feature rows of their own level (a branch of 3 leaves dead lanes in the kernel's power-of-two
    vector, where an argmax over NaN landed on an H200 and index_select then faulted)."""
    from streamsd.kernels.tree import grow as kg
    from streamsd.spec_decode.eagle import tree as et

    b, m, c, depth, bs = 2, 3, 3, 3, 4
    pending = torch.tensor([5, 9], device=DEV)
    table = torch.arange(12, dtype=torch.int32, device=DEV).view(b, 6)
    total = c + (depth - 1) * m * c
    cands, base, offset = et.Candidates.empty(b, total, DEV), et.Frontier.root(b, DEV), 0
    for level in range(1, depth):
        p = base.scores.shape[1]
        s = torch.full((b * p, c), float("nan"), device=DEV)
        s[:p] = torch.tensor([-0.1, -1.0, -2.0], device=DEV)  # request 0 real, request 1 garbage
        t = torch.arange(b * p * c, device=DEV).view(b * p, c)
        fr = kg.expand_level(s, t, base, offset, cands, m, level, pending, table, bs)
        assert fr is not None
        rows, index = fr.rows.view(b, m).cpu(), fr.index.cpu()
        for r in range(b):
            assert ((rows[r] >= r * p) & (rows[r] < (r + 1) * p)).all(), (level, r, rows[r])
            assert ((index[r] >= offset) & (index[r] < offset + p * c)).all(), (level, r, index[r])
        offset += p * c
        base = fr
