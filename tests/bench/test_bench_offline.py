"""`streamsd bench offline` on the tiny models, on the CPU: cells, JSON, plot, and losslessness."""

from __future__ import annotations

import json

import pytest
import torch

from streamsd.bench import offline_run
from streamsd.bench.compare import FASTER, SLOWER, WITHIN_NOISE
from streamsd.cli import build_parser
from streamsd.spec_decode.synthetic import SyntheticProposer


def _args(*extra: str):
    return build_parser().parse_args(["bench", "offline", "--device", "cpu", "--max-tokens", "12", *extra])


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_draft_cells_json_plot_and_hf(tmp_path, tiny_model_dir, tiny_draft_dir):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    args = _args("--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--speculative-method",
                 "draft", "--batch-sizes", "1,2", "--output-json", str(out), "--plot", str(png))
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert png.stat().st_size > 1000
    cells = {(c["engine"], c["method"], c["batch"]): c for c in doc["cells"]}
    assert set(cells) == {("streamsd", "plain", 1), ("streamsd", "draft", 1), ("hf", "plain", 1),
                          ("hf", "assisted", 1), ("streamsd", "plain", 2), ("streamsd", "draft", 2),
                          ("hf", "plain", 2), ("hf", "assisted", 2)}
    assert cells[("hf", "assisted", 1)]["tpot_ms"] > 0 and "note" in cells[("hf", "assisted", 2)]
    spec = cells[("streamsd", "draft", 2)]
    assert spec["same_output_as_plain"]  # lossless: greedy speculation == plain greedy, token for token
    assert spec["c"] > 0 and spec["analytic_speedup"] > 0 and spec["tokens"] == 2 * 12
    plain = cells[("streamsd", "plain", 1)]
    assert plain["tokens"] == 12 and plain["tpot_ms"] > 0 and plain["floor_ratio"] > 1
    assert plain["hf_tpot_ms"] > 0 and plain["x_hf_tokens_per_s"] > 0


def test_a_draft_model_alone_means_draft_speculation_and_hf_assisted_runs_at_batch_one_only(
        tmp_path, tiny_model_dir, tiny_draft_dir):
    out = tmp_path / "d.json"
    # Two prompts a cell: HF's assisted generation refuses a batch of two, so that cell is a note.
    args = _args("--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--batch-sizes", "1,2",
                 "--num-prompts", "2", "--output-json", str(out))
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["method"] == "draft"
    cells = {(c["engine"], c["method"], c["batch"]): c for c in doc["cells"]}
    assert ("streamsd", "draft", 1) in cells and ("streamsd", "draft", 2) in cells
    for b in (1, 2):
        assisted = cells[("hf", "assisted", b)]
        assert assisted["note"] == "n/a: HF assisted generation supports batch 1 only" and "tpot_ms" not in assisted
        assert cells[("hf", "plain", b)]["tpot_ms"] > 0


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_synthetic_acceptance_is_what_was_asked(tmp_path, tiny_model_dir, alpha):
    out = tmp_path / "s.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "synthetic", "--acceptance-rate", str(alpha),
                 "--batch-sizes", "4", "--max-tokens", "40", "--no-hf", "--output-json", str(out))
    assert args.func(args) == 0
    cell = next(c for c in json.loads(out.read_text())["cells"] if c["method"] == "synthetic")
    assert cell["same_output_as_plain"] and cell["desyncs"] == 0 and cell["c"] == 0
    if alpha == 1.0:
        assert cell["acceptance"] == 1.0 and cell["tau"] > 4.0
    else:
        assert 0.3 < cell["acceptance"] < 0.7


def test_ngram_runs_and_stays_lossless(tmp_path, tiny_model_dir):
    out = tmp_path / "n.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "ngram", "--batch-sizes", "1",
                 "--no-hf", "--output-json", str(out))
    assert args.func(args) == 0
    cell = next(c for c in json.loads(out.read_text())["cells"] if c["method"] == "ngram")
    assert cell["same_output_as_plain"] and cell["c"] == 0


def test_analytic_speedup_and_floor_math():
    assert offline_run.analytic_speedup(0.0, 4, 0.0) == 1.0
    assert offline_run.analytic_speedup(1.0, 4, 0.0) == 5.0
    assert abs(offline_run.analytic_speedup(0.8, 4, 0.05) - (1 - 0.8**5) / 0.2 / 1.2) < 1e-12


def test_synthetic_proposer_desyncs_when_history_leaves_the_oracle(tiny_model_dir):
    from streamsd.request import Request, SamplingParams
    from streamsd.spec_decode.proposer import ProposeItem

    prop = SyntheticProposer({(1, 2): [5, 6, 7, 8, 9]}, alpha=1.0, vocab=50)
    r = Request("a", [1, 2], SamplingParams(), seed=3, arrival=0.0)
    assert prop.propose([ProposeItem(r, [1, 2, 5], 3, 3, 0)])[0].draft_ids == [6, 7, 8]
    assert prop.counters.desyncs == 0
    drafts = prop.propose([ProposeItem(r, [1, 2, 5, 4], 3, 4, 0)])[0].draft_ids  # 4 is not the oracle's 6
    assert prop.counters.desyncs == 1 and len(drafts) == 3


def test_random_weight_preset_runs_with_hf_sharing_its_weights(tmp_path, monkeypatch):
    """The preset path (random weights made on the device, synthetic tokenizer, HF model built on
    the same tensors) with a tiny shape standing in for the 8B one."""
    from types import MappingProxyType

    from streamsd.model import presets

    tiny = dict(presets.PRESETS["llama-3.2-1b"], vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=2048)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "tiny-preset": tiny}))
    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path))
    out = tmp_path / "p.json"
    args = _args("--model", "tiny-preset", "--draft-model", "tiny-preset", "--speculative-method", "synthetic",
                 "--batch-sizes", "2", "--prompt-len", "16", "--output-json", str(out))
    assert args.func(args) == 0
    cells = json.loads(out.read_text())["cells"]
    spec = next(c for c in cells if c["method"] == "synthetic")
    assert spec["same_output_as_plain"] and 0 < spec["c"] and spec["desyncs"] == 0
    assert any(c["engine"] == "hf" for c in cells)


def test_synthetic_proposer_follows_another_recorded_branch_at_a_tie():
    """A history that takes the other side of a near-tie (another GEMM shape, another winner) stays
    in sync when that side was recorded by an earlier pass; only a history outside every branch is
    a desync."""
    from streamsd.request import Request, SamplingParams
    from streamsd.spec_decode.proposer import ProposeItem

    prop = SyntheticProposer({(1, 2): [5, 6, 7, 8, 9]}, alpha=1.0, vocab=50)  # the plain pass
    prop.add({(1, 2): [5, 6, 4, 3, 2]})  # a warm-up spec pass that broke the tie at output 2 the other way
    r = Request("a", [1, 2], SamplingParams(), seed=3, arrival=0.0)
    # The newest branch is followed first ...
    assert prop.propose([ProposeItem(r, [1, 2, 5], 3, 3, 0)])[0].draft_ids == [6, 4, 3]
    # ... and a history that took the plain side continues on the plain branch.
    assert prop.propose([ProposeItem(r, [1, 2, 5, 6, 7], 2, 5, 0)])[0].draft_ids == [8, 9]
    assert prop.counters.desyncs == 0
    r2 = Request("b", [1, 2], SamplingParams(), seed=4, arrival=0.0)
    prop.propose([ProposeItem(r2, [1, 2, 5, 6, 11], 2, 5, 0)])  # 11: on no branch
    assert prop.counters.desyncs == 1


def test_adaptive_synthetic_acceptance_in_every_cell(tmp_path, tiny_model_dir):
    """Regression: under --speculation-policy adaptive the B = 64 cell measured alpha = 0 — the
    policy never speculated, because its cost table (one sequence of N tokens) missed what a batch
    of requests costs on its own (now timed per batch x width, which
    test_startup_profile_times_the_engines_step_shape_within_its_budget checks; the planner's
    choices given a table are test_adaptive_planner.py's) and its warm-up pass's lessons carried into the
    measured pass. Here every cell must stay exact and report its step times and predictions, and a
    cell that speculated must measure the alpha asked for. Whether a cell speculates is not asserted:
    it rides on step times measured on this CPU, where a verify of 5 tokens a request costs 1.3-2x a
    plain step of the tiny target, close to break-even against the planner's pessimistic prior
    (0 drafts in 3 of 8 runs at B = 16, 1 of 6 at B = 1 beside a busy loop)."""
    out = tmp_path / "a.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "synthetic", "--acceptance-rate", "0.8",
                 "--speculation-policy", "adaptive", "--batch-sizes", "1,16,64", "--max-tokens", "48", "--no-hf",
                 "--forced-plain", "--output-json", str(out))
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["profile"]["widths"] == [1, 2, 3, 4, 5] and doc["profile"]["cells_timed"] >= 10
    cells = {(c["method"], c["batch"]): c for c in doc["cells"]}
    for b in (1, 16, 64):
        spec, plain = cells[("synthetic", b)], cells[("plain", b)]
        assert spec["same_output_as_plain"] and spec["desyncs"] == 0, b
        if spec["drafts_tested"] >= 10 * b:
            # Corruption is a pure function of (seed, position): the band is wide only where few are tested.
            lo, hi = (0.55, 1.0) if b == 1 else (0.7, 0.9)
            assert lo < spec["acceptance"] < hi and spec["tau"] > 1.0, (b, spec["acceptance"], spec["tau"])
        assert spec["pred_err_pct"] is not None and spec["adaptive"]["observed_steps"] > 0, b
        shapes = spec["adaptive"]["by_shape"]  # Σ predicted / Σ measured per (batch x verify tokens)
        assert sum(v["steps"] for v in shapes.values()) == spec["adaptive"]["observed_steps"], b
        assert all(v["ratio"] > 0 for v in shapes.values()), b
        for c in (spec, plain):  # the decode-only step time, besides TPOT
            assert c["decode_steps"] > 0 and c["decode_step_ms"] > 0 and c["decode_step_floor_ratio"] > 0, b
            assert c["decode_tokens_per_s"] > 0, b
        assert spec["decode_speedup"] > 0, b
    assert cells[("plain", 1)]["acceptance"] is None  # nothing drafted: no acceptance, not 0
    for b in (1, 16, 64):  # --forced-plain: the speculative engine with k capped at 0 drafts nothing
        forced = cells[("spec k=0", b)]
        assert forced["drafts_tested"] == 0 and forced["acceptance"] is None and forced["same_output_as_plain"], b
        assert forced["decode_step_vs_plain"] > 0 and forced["measured_speedup"] > 0, b


def test_startup_profile_times_the_engines_step_shape_within_its_budget(tiny_model_dir):
    """The adaptive policy's table is timed as B requests x (1 + k) tokens for every batch edge up to
    max_num_seqs; with no time left it still covers every cell (extrapolated, never cheaper)."""
    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime
    from streamsd.policy.policy import AdaptivePolicy
    from streamsd.worker.profile import profile_costs

    rt = build_runtime(EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method="ngram", policy="adaptive"),
                                    device="cpu", max_num_seqs=16, cpu_threads=1))
    assert isinstance(rt.policy, AdaptivePolicy)
    shape = rt.policy.cost.shape
    assert shape is not None and not shape.padded
    # Every width where a step is small (<= 16 tokens: GEMMs far from linear in rows), 1 and 1 + K elsewhere.
    assert shape.batches == (1, 2, 4, 8, 16) and shape.widths == (1, 2, 3, 4, 5) and shape.timed == 5 + 5 + 5 + 3 + 2
    w = rt.worker
    rushed = profile_costs(w.target, w.cache, None, None, 2048, max_batch=16, max_k=4, budget_s=0.0).shape
    assert rushed is not None and rushed.timed == 1 and rushed.batches == shape.batches
    for row in rushed.values:
        assert row[0] <= row[1]
    assert [row[0] for row in rushed.values] == sorted(row[0] for row in rushed.values)


def test_measured_passes_start_from_the_acceptance_prior_their_cell_learnt(tiny_model_dir):
    """Each pass gets a new adaptive policy: warm-up passes keep only the cost table; measured passes
    also keep the proposer's running acceptance prior (a copy: a pass's lessons stay its own until
    the next pass starts from them), as a running server's policy does across waves of requests."""
    from streamsd.bench.offline_cells import Policies
    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime

    rt = build_runtime(EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method="ngram", policy="adaptive"),
                                    device="cpu", max_num_seqs=4, cpu_threads=1))
    policies = Policies(k=4, cost=rt.policy.cost)
    first = policies.fresh(rt, 16)
    est = first.policy.estimator
    default = est.prior("default").means[0]
    state = est.new_request()
    for _ in range(40):
        est.observe(state, 4, 0)  # every first draft rejected
    est.tick()
    learnt = est.prior("default").means[0]
    assert learnt < default - 0.3
    warm = policies.fresh(rt, 16, first)
    assert warm.policy.estimator.prior("default").means[0] == default
    measured = policies.fresh(rt, 16, first, acceptance=True)
    assert measured.policy.estimator.prior("default").means[0] == learnt
    assert measured.policy.cost is not first.policy.cost
    measured.policy.estimator.observe(measured.policy.estimator.new_request(), 4, 4)
    measured.policy.estimator.tick()
    assert est.prior("default").means[0] == learnt


def test_paired_plain_compares_each_cell_with_the_plain_pass_before_it(tmp_path, tiny_model_dir):
    """--paired-plain: each speculative cell's ratios use a plain pass run just before it (the machine
    drifts between passes), and the cell says how far that pass was from the batch's first one."""
    out = tmp_path / "p.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "synthetic", "--acceptance-rate", "0.8",
                 "--batch-sizes", "2", "--max-tokens", "16", "--no-hf", "--forced-plain", "--paired-plain",
                 "--output-json", str(out))
    assert args.func(args) == 0
    cells = json.loads(out.read_text())["cells"]
    plain = next(c for c in cells if c["method"] == "plain")
    assert "plain_drift" not in plain
    for c in cells:
        if c["method"] in ("synthetic", "spec k=0"):
            paired = c["paired_plain_tpot_ms"]
            assert paired > 0 and c["plain_drift"] == pytest.approx(paired / plain["tpot_ms"], rel=0.01)
            assert c["measured_speedup"] == pytest.approx(paired / c["tpot_ms"], rel=0.01)
            assert c["same_output_as_plain"]


def test_pairs_report_the_median_pair_and_every_pairs_ratio(tmp_path, tiny_model_dir):
    """--pairs 3: three (plain, measured) pairs per cell; the cell's numbers are its median pair's."""
    out = tmp_path / "p.json"
    args = _args("--model", str(tiny_model_dir), "--speculative-method", "synthetic", "--acceptance-rate", "0.8",
                 "--batch-sizes", "2", "--max-tokens", "12", "--no-hf", "--forced-plain", "--paired-plain",
                 "--pairs", "3", "--speculation-policy", "adaptive", "--output-json", str(out))
    assert args.func(args) == 0
    cells = [c for c in json.loads(out.read_text())["cells"] if c["method"] in ("synthetic", "spec k=0")]
    assert len(cells) == 2
    for c in cells:
        assert c["pairs"] == 3 and len(c["pair_measured_speedup"]) == 3
        assert c["measured_speedup"] == sorted(c["pair_measured_speedup"])[1]
        assert c["same_output_as_plain"]
        # The cell's plain passes against each other: the noise its verdict reads the median against.
        tpots = c["pair_plain_tpot_ms"]
        # (each TPOT is rounded to 0.001 ms, the spread to 1e-4: the spread of the rounded values is near it)
        low, high = (max(tpots) - 5e-4) / (min(tpots) + 5e-4) - 1, (max(tpots) + 5e-4) / (min(tpots) - 5e-4) - 1
        assert len(tpots) == 3 and low - 1e-4 <= c["plain_spread"] <= high + 1e-4, (tpots, c["plain_spread"])
        assert c["verdict"] in (FASTER, WITHIN_NOISE, SLOWER)
        assert (c["verdict"] == FASTER) == (c["measured_speedup"] >= 1.0)


def test_an_even_number_of_pairs_reports_the_lower_middle_pair():
    """Two pairs read 1.37 and 0.85 on an H200 (B = 1, one 64-token request): the cell must not report
    the better one."""
    from types import SimpleNamespace

    from streamsd.bench.offline_cells import _median_pair

    plain = SimpleNamespace(tpot_ms=4.6)
    passes = [(SimpleNamespace(tpot_ms=t), SimpleNamespace(tpot_ms=4.6), i) for i, t in enumerate((3.36, 5.4))]
    assert _median_pair(passes, plain)[2] == 1  # the slower speculative pass: 0.85x
    three = [*passes, (SimpleNamespace(tpot_ms=4.0), None, 2)]
    assert _median_pair(three, plain)[2] == 2  # odd: the median itself (4.6 / 4.0)


def test_synthetic_drafts_made_on_the_device_equal_the_hosts(tiny_model_dir):
    """SyntheticProposer.chain (a gather behind the sampler, from the accepted counts on the device)
    drafts what the host path drafts for the same history, including past the branch's end (all
    corrupted) and after a branch switch that the host saw at the previous read."""
    from streamsd.request import Request, SamplingParams
    from streamsd.spec_decode.proposer import ProposeItem

    cont = [5, 6, 7, 8, 9, 10, 11, 12]
    for alpha in (1.0, 0.6, 0.0):
        prop = SyntheticProposer({(1, 2): cont}, alpha=alpha, vocab=50)
        prop.add({(1, 2): [5, 6, 4, 3, 2, 1, 0, 9]})  # another branch, preferred until the history leaves it
        host = SyntheticProposer({(1, 2): cont}, alpha=alpha, vocab=50)
        host.add({(1, 2): [5, 6, 4, 3, 2, 1, 0, 9]})
        r = Request("a", [1, 2], SamplingParams(max_tokens=12), seed=7, arrival=0.0)
        history = [5, 6, 7, 8, 9, 10, 11, 12, 3, 3, 3]  # the plain branch (from output 2 on), then off both
        for known, accepted in ((1, 0), (1, 2), (2, 1), (4, 3), (6, 2), (9, 0)):
            r.output_ids = history[:known]  # what the host had read before this verify
            start = 2 + known - 1  # the pending token's position
            got = prop.chain([r], [start], [4], [3], torch.zeros(1, 4, dtype=torch.int64),
                             torch.tensor([accepted]), None)
            after = [1, 2, *history[: known + accepted + 1]]  # the history once this verify is read
            want = host.propose([ProposeItem(r, after, 3, len(after), 0)])[0].draft_ids
            def branch(n: int) -> str:  # which branch a history of n output tokens follows
                return "newest" if n <= 2 else "plain" if n <= len(cont) else "none"

            if branch(known) == branch(known + accepted + 1):  # the device's view is a read behind
                assert got.tolist() == [want], (alpha, known, accepted)
            assert got.shape == (1, 3)
        device_starts = torch.tensor([2 + 4 - 1])  # a queued verify: its start only on the device
        r.output_ids = history[:4]
        got = prop.chain([r], [0], [4], [2], torch.zeros(1, 4, dtype=torch.int64), torch.tensor([1]), None,
                         device_starts=device_starts)
        want = host.propose([ProposeItem(r, [1, 2, *history[:6]], 2, 8, 0)])[0].draft_ids
        assert got.tolist() == [want]


@pytest.mark.parametrize("alpha", [1.0, 0.6])
def test_synthetic_steps_queue_ahead_and_change_nothing(tiny_model_dir, alpha):
    """With its drafts made on the device, a synthetic speculative step queues the next one before
    it is read (pipelined, here on the CPU): outputs equal plain decoding, and drafted / accepted
    counts equal the engine that reads every step first (both with one k to max_tokens, as the
    benchmark runs them: builder.queue_chains)."""
    import dataclasses

    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime, queue_chains

    spec = SpecConfig(method="synthetic", num_tokens=4, policy="fixed")
    prompts = [[3 + i, 40 + 7 * i, 11, 90 - i, 5] for i in range(6)]
    runs = []
    for pipeline in (False, True):
        rt = build_runtime(EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method=None, num_tokens=4),
                                        device="cpu", max_num_seqs=4, pipeline=pipeline))
        warm_up_taken = rt.worker.lookahead.taken
        plain = offline_run.engine_pass(rt, dataclasses.replace(spec, method=None), prompts, 40, 4, speculative=False)
        oracle = {tuple(p): o for p, o in zip(prompts, plain.outputs, strict=True)}
        rt.worker.use_proposer(SyntheticProposer(oracle, alpha, rt.args.vocab_size))
        rt = dataclasses.replace(rt, scheduler_config=queue_chains(rt.worker, rt.scheduler_config, 4))
        res = offline_run.engine_pass(rt, spec, prompts, 40, 4, speculative=True)
        assert res.outputs == plain.outputs and res.drafted > 100
        assert rt.worker.proposer.counters.desyncs == 0
        la = rt.worker.lookahead
        assert (la.taken > 10) == pipeline, (la.taken, la.dropped)
        assert res.queued_taken == (la.taken - warm_up_taken - plain.queued_taken if pipeline else 0)  # the pass's own count
        runs.append((res.drafted, res.accepted, res.verify_steps))
        if alpha == 1.0:
            assert res.accepted == res.drafted
    assert runs[0] == runs[1]


@pytest.mark.parametrize("k", [2, 4])
def test_a_batch_that_starts_together_takes_every_queued_step(tiny_model_dir, k):
    """Eight requests that start together and end at max_tokens, synthetic drafts queued ahead at
    k = 2 or 4: no request joins, so every step queued is taken, but the one behind the last step,
    which no plan needs. (A trim that kept 2 (k + 1) tokens past the pending one freed a block the
    queued step had recorded whenever a step accepted nothing: four of these steps were dropped.)"""
    import dataclasses

    from streamsd.config import EngineConfig, SpecConfig
    from streamsd.engine.builder import build_runtime, queue_chains

    prompts = [[3 + i, 40 + 7 * i, 11, 90 - i, 5] for i in range(8)]
    rt = build_runtime(EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method=None, num_tokens=k),
                                    device="cpu", max_num_seqs=8, pipeline=True))
    spec = SpecConfig(method="synthetic", num_tokens=k, policy="fixed")
    plain = offline_run.engine_pass(rt, dataclasses.replace(spec, method=None), prompts, 32, 8, speculative=False)
    oracle = {tuple(p): o for p, o in zip(prompts, plain.outputs, strict=True)}
    rt.worker.use_proposer(SyntheticProposer(oracle, 0.7, rt.args.vocab_size))
    rt = dataclasses.replace(rt, scheduler_config=queue_chains(rt.worker, rt.scheduler_config, k))
    la = rt.worker.lookahead
    taken, dropped = la.taken, la.dropped
    res = offline_run.engine_pass(rt, spec, prompts, 32, 8, speculative=True)
    assert res.outputs == plain.outputs
    assert la.dropped - dropped == 1 and la.taken - taken >= 10, (la.taken - taken, la.dropped - dropped)
