"""The fused forward, its graphs and warm-up, the fast EAGLE layer and the restart kernel against eager."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpret import CUDA, DEV  # isort: skip (first: it sets the interpreter up)
import streamsd.kernels.attention.paged as pa
import streamsd.kernels.sample.rejection as rj
import streamsd.model.attention as ta
from streamsd.kernels.attention.prefill import prefill_attention, prefill_tiles, tokens_per_tile
from streamsd.model.kv_cache import BatchLayout
from streamsd.sample import rng
from tests.kernels.kernel_helpers import rel_error


def _assert_fast_matches_reference(results: list) -> None:
    """results: [(reference outputs, reference cache), (fast outputs, fast cache)], fused vs eager."""
    (ref, ref_cache), (out, out_cache) = results
    tol = 2e-2 if CUDA else 1e-5
    for a, b in zip(out, ref, strict=True):
        assert a.shape == b.shape and rel_error(a, b) < tol
    assert rel_error(out_cache, ref_cache) < tol


# -- the whole engine on CUDA: graphs + kernels keep greedy speculation exact ----------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n", [6, 16])  # a padded bucket (8) and a full one (16)
def test_cuda_engine_greedy_spec_equals_plain_through_graphs(tiny_model_dir, close_draft_dir, n):
    from streamsd.engine.llm import LLM
    from streamsd.request import SamplingParams

    prompts = [[5, 6, 7, 8, 9, 10, 11][: 2 + i % 6] * (i % 5 + 1) + [20 + i] for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    spec = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), device="cuda", dtype="float32",
               kv_cache_tokens=8192)
    a = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    b = [r.outputs[0].token_ids for r in spec.generate(prompts, params)]
    assert a == b
    worker = spec.core.rt.worker
    assert worker.graphs.replays > 0 and worker.proposer.graphs.replays > 0
    assert plain.core.rt.worker.graphs.replays > 0
    assert sum(r.spec_stats.accepted for r in spec.generate(prompts[:2], params)) > 0


def test_fast_forward_matches_reference_forward(tiny_model_dir):
    """Fused weights + Triton add-RMSNorm, RoPE/KV write and SiLU*mul give the eager forward's
    logits, captured residual streams (what an EAGLE head reads: the embedding, a middle layer's
    input, the final pre-norm stream) and cache contents, over a prefill (SDPA) and a
    verify-shaped step (the kernel); and streams written straight into a stream store."""
    from streamsd.model.fast_forward import enable_fast_forward
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.loader import load_model

    dtype = torch.bfloat16 if CUDA else torch.float32
    model, _ = load_model(str(tiny_model_dir), DEV, dtype)
    bs = 16
    lens, tables = [20, 9], [[3, 0], [2]]
    g = torch.Generator().manual_seed(1)
    steps = [([0, 0], lens), (lens, [3, 1])]  # (starts, counts): a prefill, then a verify-shaped step
    ids = [torch.randint(3, model.args.vocab_size, (sum(c),), generator=g).to(DEV) for _, c in steps]
    results = []
    for fast in (False, True):
        cache = PagedKVCache(model.args, 5, bs, dtype, DEV)
        if fast:
            model.attend = pa.paged_attention
            enable_fast_forward(model)
        outs = []
        for (s, c), i in zip(steps, ids, strict=True):
            rows = torch.arange(sum(c), device=DEV)
            o = model(i, BatchLayout.build(s, c, tables, bs, DEV), cache, rows[-2:], hidden_layers=(0, 1, 2),
                      hidden_rows=rows.flip(0))  # streams at every row (reversed), logits at two
            assert o.hidden is not None and len(o.hidden) == 3
            outs.extend([o.logits, *o.hidden])
        # The verify step again, its streams of two inner layers straight into a stream store (the
        # fast path writes them from its add+RMSNorm): the store's rows at the step's slots are the
        # streams the step returns otherwise. (The step rewrites the same K/V.)
        layout = BatchLayout.build(*steps[1], tables, bs, DEV)
        rows = torch.arange(sum(steps[1][1]), device=DEV)
        assert model.args.num_layers == 2  # (1,): an inner layer's; (1, 2): the final stream's too, after the loop
        for layers in ((1,), (1, 2)):
            store = torch.zeros(5 * bs, len(layers) * model.args.hidden_size, dtype=dtype, device=DEV)
            direct = model(ids[1], layout, cache, rows, hidden_layers=layers, streams_into=store)
            returned = model(ids[1], layout, cache, rows, hidden_layers=layers, hidden_rows=rows)
            assert direct.hidden is None and returned.hidden is not None
            assert torch.equal(store[layout.slot_mapping], torch.cat(returned.hidden, dim=-1))
            assert store.count_nonzero() == store[layout.slot_mapping].count_nonzero() > 0
            outs.append(store)
        results.append((outs, cache.data.clone()))
    _assert_fast_matches_reference(results)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replay_returns_the_eager_hidden_streams(tiny_model_dir):
    """A runner that captures an EAGLE head's streams: its replay's logits and streams equal the
    eager (fast) forward's, for a verify-shaped step padded into a (bucket 4, width 4) graph."""
    from streamsd.model.fast_forward import enable_fast_forward
    from streamsd.model.graphs import GraphConfig, GraphRunner
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.loader import load_model

    model, _ = load_model(str(tiny_model_dir), DEV, torch.float32)
    model.attend = pa.paged_attention
    enable_fast_forward(model)
    scratch, bs, layers = 12, 16, (0, 1, 2)
    cache = PagedKVCache(model.args, scratch + 1, bs, torch.float32, DEV)
    lens, tables = [20, 40, 9], [[3, 0], [5, 1, 7], [2]]
    g = torch.Generator().manual_seed(0)
    flat = torch.randint(3, model.args.vocab_size, (sum(lens),), generator=g).to(DEV)
    model(flat, BatchLayout.build([0, 0, 0], lens, tables, bs, DEV), cache, torch.arange(flat.numel(), device=DEV))
    counts = [1, 3, 2]
    ids = torch.randint(3, model.args.vocab_size, (sum(counts),), generator=g).tolist()
    rows = [0, 3, 5]  # the verify rows the worker asks for: not an arange, so the gather path runs too
    before = cache.data.clone()
    all_rows = torch.arange(sum(counts), device=DEV)
    ref = model(torch.tensor(ids, device=DEV), BatchLayout.build(lens, counts, tables, bs, DEV), cache,
                torch.tensor(rows, device=DEV), hidden_layers=layers, hidden_rows=all_rows)
    ref_hidden = torch.cat(ref.hidden, dim=-1)  # [T, 3 * hidden], as the full step's forward builds it
    cache.data.copy_(before)
    runner = GraphRunner(model, cache, scratch, GraphConfig(max_blocks=8, query_widths=(1, 4)), DEV,
                         hidden_layers=layers)
    key = runner.key_for(counts, tables)
    assert key == (4, 4)
    for _ in range(2):  # the capture's first replay, then a replay of the stored graph
        cache.data.copy_(before)
        logits, hidden = runner.run_hidden(key, ids, lens, counts, tables, rows)
        assert hidden.shape == ref_hidden.shape
        assert rel_error(logits, ref.logits) < 1e-4 and rel_error(hidden, ref_hidden) < 1e-4
    assert runner.replays == 2 and len(runner.graphs) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_warm_up_compiles_every_variant_a_step_can_reach(tiny_model_dir):
    """After the start-up warm-up, steps of any batch size, draft count, query width and block-table
    width compile nothing (a compile inside a step stalled it for a few hundred ms on an H200)."""
    import streamsd.kernels.sample.rng as krng
    from streamsd.kernels.warmup import begin_warm_up, compiled_variants
    from streamsd.model.loader import load_model
    from streamsd.sample.rejection import VerifyInput

    model, _ = load_model(str(tiny_model_dir), DEV, torch.bfloat16)
    a, vocab, bs, max_k = model.args, model.args.vocab_size, 16, 4
    begin_warm_up([model], torch.bfloat16, bs, vocab, max_k, DEV).finish()
    before = compiled_variants()
    g = torch.Generator().manual_seed(0)
    for b in (1, 3, 4, 7, 16):
        for k in range(1, max_k + 1):
            # per-request rows sliced out of one packed buffer, as Verifier.launch sends them
            ints = torch.randint(0, 2, (3 * b + b * (k + 1) + b * k,), generator=g).to(DEV)
            seeds, at = ints[b : 2 * b], 3 * b + b * (k + 1)
            positions, drafts, greedy = ints[3 * b : at].view(b, k + 1), ints[at:].view(b, k), ints[:b].bool()
            krng.exponentials(seeds, drafts, rng.TARGET, vocab)  # seeds, positions: packed slices
            krng.uniforms(seeds, drafts[:, : max(k - 1, 1)], rng.ACCEPT)
            for sampled, dense in ((False, False), (True, False), (True, True)):
                p = torch.softmax(torch.randn(b, k + 1, vocab, generator=g), -1).to(DEV) if sampled else None
                q = torch.softmax(torch.randn(b, k, vocab, generator=g), -1).to(DEV) if dense else None
                # the sampler hashes its own uniforms and noise from (seed, position)
                rj.rejection_sample(VerifyInput(
                    target_probs=p, target_argmax=torch.zeros(b, k + 1, dtype=torch.int64, device=DEV),
                    draft_ids=drafts, draft_probs=q, dense_q=ints[2 * b : 3 * b].bool(),
                    num_drafts=ints[2 * b : 3 * b], greedy=greedy if sampled else torch.ones_like(greedy),
                    uniforms=None, noise=None, seeds=seeds, positions=positions))
    cache = torch.zeros(64, bs, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16, device=DEV)
    for seqs, width, qlen in [(1, 1, 1), (3, 3, 2), (5, 17, 5), (40, 16, 3), (2, 33, 16), (9, 2, 7)]:
        q = torch.randn(seqs * qlen, a.num_heads, a.head_dim, dtype=torch.bfloat16, device=DEV)
        table = torch.randint(0, 64, (seqs, width), dtype=torch.int32, device=DEV)
        ctx = torch.full((seqs,), width * bs - 1, dtype=torch.int32, device=DEV)
        starts = torch.arange(0, seqs * qlen + 1, qlen, dtype=torch.int32, device=DEV)
        pa.decode_attention(q, cache, cache, table, ctx, starts, 0.1, qlen)
    for lens, width in [([17], 2), ([300, 40], 20), ([64, 5, 100], 7)]:  # prompt chunks of eager steps
        q = torch.randn(sum(lens), a.num_heads, a.head_dim, dtype=torch.bfloat16, device=DEV)
        table = torch.randint(0, 64, (len(lens), width), dtype=torch.int32, device=DEV)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        tiles = prefill_tiles(starts, lens, lens, pa.KERNEL_MAX_QUERY, tokens_per_tile(a.num_heads, a.num_kv_heads))
        prefill_attention(q, cache, cache, table, tiles, 0.1, torch.empty_like(q))
    from streamsd.kernels.model.device_layout import restart
    from streamsd.model.device_layout import DeviceStarts

    for b in (1, 3, 4, 7, 16):  # a verify queued ahead, into a graph's packed buffer (bucket x width)
        for k in range(1, max_k + 1):
            width, t_all = k + 1, b * (k + 1)
            packed = torch.zeros(3 * t_all + 2 * b + 1, dtype=torch.int64, device=DEV)
            rows = torch.zeros(4 * b + 1, dtype=torch.int64, device=DEV)  # views at odd offsets, as a chain graph's
            table = torch.zeros(b, 3 + b, dtype=torch.int32, device=DEV)
            prev, acc = rows[1 : 1 + b], rows[1 + b : 1 + 2 * b]
            tokens = torch.zeros(b, max_k + 1, dtype=torch.int64, device=DEV)
            drafts = torch.zeros(b, max_k, dtype=torch.int64, device=DEV)[:, :k]  # the chain's first k
            restart(packed, t_all, DeviceStarts(torch.empty(b, dtype=torch.int64, device=DEV), prev, acc, tokens,
                                                drafts), width, table, bs)
            restart(packed, t_all, DeviceStarts(rows[1 + 2 * b : 1 + 3 * b]), width, table, bs, base=rows[1 + 3 * b :])
    torch.cuda.synchronize()
    assert compiled_variants() == before


@pytest.mark.parametrize("kind,norm_first", [("eagle3", False), ("eagle3", True), ("eagle1", False)])
def test_fast_eagle_head_matches_its_reference_layer(tiny_model_dir, kind, norm_first):
    """The EAGLE head's layer on the fused kernels (spec_decode/eagle/fast.py) gives the autograd layer's
    output, head KV and draft logits, over a prompt chunk (the prefill kernel) and then a catch-up of
    a verify's rows and a one-token chain step (the decode kernel), for both EAGLE-3 residuals and EAGLE-1;
    the second step takes its hidden inputs by row index, as a tree level does."""
    from streamsd.model.kv_cache import PagedKVCache
    from streamsd.model.loader import load_model
    from streamsd.spec_decode.eagle.checkpoint import new_head
    from streamsd.spec_decode.eagle.fast import fast_head

    dtype = torch.bfloat16 if CUDA else torch.float32
    target, _ = load_model(str(tiny_model_dir), DEV, dtype)
    torch.manual_seed(0)
    head = new_head(target, kind=kind, norm_before_residual=norm_first)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    head = head.to(dtype)
    bs, tables = 16, [[3, 0], [2]]
    steps = [([0, 0], [20, 9]), ([20, 9], [5, 1])]  # (starts, counts)
    g = torch.Generator().manual_seed(1)
    width = head.fc.in_features if kind == "eagle3" else target.args.hidden_size
    inputs = [(torch.randint(3, target.args.vocab_size, (sum(c),), generator=g).to(DEV),
               torch.randn(sum(c), width, generator=g).to(DEV, dtype)) for _, c in steps]
    scale = head.spec.args.head_dim ** -0.5
    results = []
    with torch.no_grad():  # the head's parameters train elsewhere; here they only infer
        for fast in (False, True):
            cache = PagedKVCache(head.spec.args, 5, bs, dtype, DEV)
            kv = cache.layer(0)
            runner = fast_head(head, pa.paged_attention) if fast else None
            outs = []
            for (s, c), (ids, streams) in zip(steps, inputs, strict=True):
                layout = BatchLayout.build(s, c, tables, bs, DEV)
                feats = head.features(streams)
                if runner is not None and s[0]:  # a tree level's form: each token's input picked by row
                    rows = torch.arange(feats.shape[0] - 1, -1, -1, device=DEV)
                    out = runner.run_layer(ids, feats.flip(0), layout, kv, rows)
                elif runner is not None:
                    out = runner.run_layer(ids, feats, layout, kv)
                else:
                    def attend(q, k, v, layout=layout, kv=kv):
                        PagedKVCache.write(kv[0], kv[1], k, v, layout.slot_mapping)
                        return ta.paged_attention(q, kv[0], kv[1], layout, scale)

                    out = head.run_layer(ids, feats, layout.positions, attend)
                outs.extend([out, head.draft_logits(out[-2:])])
            results.append((outs, cache.data.clone()))
    _assert_fast_matches_reference(results)
    assert (head.fast_norm is not None) == (kind == "eagle3")


@pytest.mark.parametrize("mode", ["ids", "starts", "base"])
def test_restart_kernel_equals_the_torch_layout(mode):
    """kernels/model/device_layout.restart writes what model/device_layout.restart's torch path writes:
    positions, slots and context lengths of each row from its start (given, or the previous start + 1
    + accepted), the ids (bonus token at the accepted column, then the drafts), the base; nothing past
    the rows."""
    from streamsd.kernels.model import device_layout as kernel
    from streamsd.model.device_layout import DeviceStarts, restart

    g = torch.Generator().manual_seed(1)
    n, width, bs, t_all, k1 = 3, 4, 4, 16, 5
    table = torch.randint(0, 50, (4, 9), generator=g, dtype=torch.int32)
    prev = torch.tensor([3, 9, 0])
    accepted = torch.tensor([0, 3, 1])
    tokens = torch.randint(0, 99, (n, k1), generator=g)
    drafts = torch.randint(0, 99, (n, 6), generator=g)[:, : width - 1]  # a strided view, as the chain's
    outs = []
    for on_device in (False, True):
        dev = DEV if on_device else torch.device("cpu")
        packed = torch.full((3 * t_all + 9,), -7, dtype=torch.int64, device=dev)
        base = torch.full((4,), -7, dtype=torch.int64, device=dev)
        starts = torch.tensor([5, 11, 2], device=dev) if mode == "base" else torch.empty(n, dtype=torch.int64, device=dev)
        src = DeviceStarts(starts, None if mode == "base" else prev.to(dev), None if mode == "base" else accepted.to(dev),
                           tokens.to(dev) if mode == "ids" else None, drafts.to(dev) if mode == "ids" else None)
        if on_device:
            kernel.restart(packed, t_all, src, width, table.to(dev), bs, base=base if mode == "base" else None)
        else:
            restart(packed, t_all, src, width, table, bs, base=base if mode == "base" else None)
        outs.append((packed.cpu(), base.cpu(), starts.cpu()))
    (p0, b0, s0), (p1, b1, s1) = outs
    assert torch.equal(p0, p1) and torch.equal(b0, b1) and torch.equal(s0, s1)
    want_starts = prev + 1 + accepted if mode != "base" else torch.tensor([5, 11, 2])
    assert torch.equal(s0, want_starts)
    assert p0[t_all : t_all + width].tolist() == list(range(int(want_starts[0]), int(want_starts[0]) + width))
    if mode == "ids":
        assert p0[width] == tokens[1, 3] and p0[width + 1 : 2 * width].tolist() == drafts[1].tolist()
    assert (p0[n * width : t_all] == -7).all()  # rows past S untouched
