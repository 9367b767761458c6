"""EAGLE heads on tiny random targets: layouts, exactness, the output distribution, training, refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from streamsd import LLM, SamplingParams
from streamsd.engine.builder import load_model
from streamsd.model.loader import ModelLoadError
from streamsd.policy.policy import AdaptivePolicy, FixedPolicy
from streamsd.spec_decode.eagle.checkpoint import load_head, new_head, save_head
from streamsd.train.data import Sample, attach_streams
from streamsd.train.eval import evaluate
from streamsd.train.loop import TrainConfig, train, ttt_outputs
from streamsd.train.prompts import is_degenerate, read_prompts, user_prefix
from tests.engine.test_engine import (
    MAX_TOKENS,
    PROMPTS,
    _assert_free,
    assert_pairs_follow_target,
    greedy_params,
    hf_greedy,
)
from tests.tiny import CORPUS, build_model

CPU = torch.device("cpu")


def _target(model_dir):
    return load_model(str(model_dir), CPU, torch.float32)[0]


def _config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _train_head(model_dir, out: Path, kind: str, epochs: float = 30) -> Path:
    """A head that has seen the target's continuations of the test prompts: some drafts pass, some fail.
    "eagle3_norm_first": an EAGLE-3 head whose residual starts from the normalised fused states (the
    shipped head's layout)."""
    torch.manual_seed(0)  # the same head whichever tests ran before
    llm = LLM(str(model_dir))
    prompts = PROMPTS + CORPUS[:6]
    params = [SamplingParams(temperature=t, max_tokens=32, seed=i, ignore_eos=True)
              for i, t in enumerate([0.0] * len(prompts) + [1.0] * len(prompts))]
    res = llm.generate(prompts * 2, params)
    samples = [Sample(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids)) for r in res]
    target = llm.core.rt.worker.target
    norm_first = kind == "eagle3_norm_first"
    kind = "eagle3" if norm_first else kind
    draft_ids = sorted({t for s in samples for t in s.ids} | {0, 1, 2}) if kind == "eagle3" else None
    head = new_head(target, kind=kind, draft_ids=draft_ids, norm_before_residual=norm_first)
    attach_streams(target, samples, head.input_layers)
    train(head, target, samples, draft_ids or list(range(target.args.vocab_size)),
          TrainConfig(epochs=epochs, lr=1e-2, batch_tokens=1024))
    return save_head(head, out, _config(model_dir), torch.float32)


@pytest.fixture(scope="module")
def heads(tiny_model_dir, tmp_path_factory):
    return {kind: _train_head(tiny_model_dir, tmp_path_factory.mktemp(kind), kind)
            for kind in ("eagle3", "eagle1", "eagle3_norm_first")}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("kind,norm_first", [("eagle3", False), ("eagle3", True), ("eagle1", False)])
def test_layouts_round_trip(tiny_model_dir, tmp_path, kind, norm_first):
    target = _target(tiny_model_dir)
    head = new_head(target, kind=kind, draft_ids=list(range(0, 384, 2)) if kind == "eagle3" else None,
                    norm_before_residual=norm_first)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_head(head, tmp_path, _config(tiny_model_dir), torch.float32)
    cfg = _config(tmp_path)
    assert cfg["num_hidden_layers"] == 1 and cfg["target_hidden_size"] == 64 and cfg["vocab_size"] == 384
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    if kind == "eagle3":
        assert cfg["draft_vocab_size"] == 192 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert cfg["norm_before_residual"] is norm_first
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
        assert any(n.startswith("midlayer.self_attn.") for n in names) and "midlayer.hidden_norm.weight" in names
    else:
        assert "fc.weight" in names and any(n.startswith("layers.0.self_attn.") for n in names)
        assert not any(n.startswith(("midlayer.", "lm_head", "norm.")) for n in names)
    loaded = load_head(tmp_path, target, CPU, torch.float32)
    assert loaded.spec.norm_before_residual is norm_first
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Same drafts from the same states: the training unroll and the paged proposer agree too.
    ids = torch.randint(3, 300, (1, 24))
    s = Sample(ids[0].tolist(), 4)
    attach_streams(target, [s], head.input_layers, dtype=torch.float32)
    with torch.no_grad():
        x, y = ttt_outputs(head, ids, s.streams[None], 2), ttt_outputs(loaded, ids, s.streams[None], 2)
        assert all(torch.allclose(p, q) for p, q in zip(x, y, strict=True))
        logits = loaded.target_logits(y[0][0])
    if kind == "eagle3":  # ids outside the draft vocabulary can never be drafted
        assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()


def test_eagle3_head_without_a_draft_vocabulary_drafts_through_the_targets_lm_head(tiny_model_dir, tmp_path,
                                                                                   reference):
    """`train-draft --draft-vocab-size 0`: no lm_head of its own (the file holds no vocabulary-sized
    matrix), the target's frozen one serves every id; it saves, loads and stays exact."""
    target = _target(tiny_model_dir)
    head = new_head(target, kind="eagle3")
    assert not hasattr(head, "lm_head") and not head.has_draft_vocab
    save_head(head, tmp_path, _config(tiny_model_dir), torch.float32)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any(n.startswith("lm_head") for n in f.keys())
    assert _config(tmp_path)["draft_vocab_size"] == 384
    loaded = load_head(tmp_path, target, CPU, torch.float32)
    assert loaded.draft_logits(torch.randn(2, 64)).shape == (2, 384)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(tmp_path))
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy_params())] == reference
    _assert_free(llm)


@pytest.mark.parametrize("kind,k", [("eagle3", 1), ("eagle3", 4), ("eagle1", 4), ("eagle3_norm_first", 4)])
def test_greedy_eagle_is_token_identical(tiny_model_dir, heads, reference, kind, k):
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), num_speculative_tokens=k)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    stats = [r.spec_stats for r in res]
    assert sum(s.accepted for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
    _assert_free(llm)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "eagle3_norm_first"])
def test_engine_drafts_are_what_training_time_test_predicts(tiny_model_dir, heads, kind):
    """Train and inference see the same thing: each draft the engine makes (catch-up then k steps)
    equals the head's prediction at that slot in `ttt_outputs` over the finished greedy answer,
    at every depth whose earlier drafts were right (training feeds the true tokens)."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), num_speculative_tokens=4)
    proposer = llm.core.rt.worker.proposer
    calls: list[tuple[str, int, list[int]]] = []  # (request, its tokens when drafting, drafts)
    loop = proposer._draft_loop

    def recording(items, h):
        drafts = loop(items, h)
        calls.extend((it.request.request_id, len(it.tokens), row[: it.k]) for it, row in zip(items, drafts.tolist(), strict=True))
        return drafts

    proposer._draft_loop = recording
    res = {r.request_id: r for r in llm.generate(PROMPTS, greedy_params())}
    checked = _check_drafts_against_ttt(llm, res, calls)
    assert checked[0] > 20 and checked[1] > 0, checked


def _check_drafts_against_ttt(llm: LLM, res: dict, calls: list[tuple[str, int, list[int]]]) -> list[int]:
    """Asserts that 97 % of the drafts checkable (earlier ones right) at each depth equal the head's
    training-time prediction at their slot over the finished answers; returns how many were checked."""
    proposer = llm.core.rt.worker.proposer
    head, target = proposer.head, llm.core.rt.worker.target
    preds = {}
    for rid, r in res.items():
        s = Sample(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids))
        attach_streams(target, [s], head.input_layers, dtype=torch.float32)
        with torch.no_grad():
            outs = ttt_outputs(head, torch.tensor([s.ids], device=s.streams.device), s.streams[None], 4)
        preds[rid] = (s.ids, [head.target_logits(o[0]).argmax(-1).tolist() for o in outs])  # row p -> token p + 2
    same, checked = [0] * 4, [0] * 4
    for rid, n, drafts in calls:
        ids, pred = preds[rid]
        anchor = n - 2  # the last caught-up slot: the target's h and the last token
        for j, d in enumerate(drafts[:4]):
            if anchor + j + 2 >= len(ids) or (j and drafts[j - 1] != ids[anchor + j + 1]):
                break
            checked[j] += 1
            same[j] += pred[j][anchor + j] == d
    assert all(s >= 0.97 * c for s, c in zip(same, checked, strict=True)), (same, checked)
    return checked


class _Alternating(FixedPolicy):
    """`plain` steps at k = 0 for every request, then `spec` steps at the request's k, and again."""

    def __init__(self, plain: int, spec: int):
        super().__init__()
        self.plain, self.spec, self.steps = plain, spec, 0

    def choose(self, decoding, prefill_tokens, backlog):
        decision = super().choose(decoding, prefill_tokens, backlog)
        self.steps += 1
        self.speculating = (self.steps - 1) % (self.plain + self.spec) >= self.plain  # FixedPolicy.default_k reads it
        return decision


@pytest.mark.parametrize("engine", [
    "eager", "graph_body",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_a_head_resuming_after_plain_steps_catches_up_from_the_stream_store(tiny_model_dir, heads, reference,
                                                                            engine):
    """Plain stretches of an EAGLE engine are the plain engine's steps: queued ahead, no propose call,
    the target's streams kept in the stream store. A head resuming after one catches up on every
    position it skipped (more than a graph's width: eagerly, then the graph body) and drafts what the
    head's training-time test predicts at that slot, as if it had followed every step; greedy output
    equal to the target's; nothing leaked."""
    graph_body = engine == "graph_body"  # on CUDA: real graphs, the store written inside the target's
    make = _chained_engine if graph_body else (lambda d, h, **kw: LLM(
        str(d), speculative_method="eagle", draft_model=str(h), num_speculative_tokens=4, **kw))
    cuda = dict(device="cuda", dtype="float32", kv_cache_tokens=4096) if engine == "cuda" else {}
    llm = make(tiny_model_dir, heads["eagle3"], pipeline=True, **cuda)
    llm.core.scheduler.policy = _Alternating(plain=6, spec=2)
    worker = llm.core.rt.worker
    proposer = worker.proposer
    resumed: list[tuple[str, int, list[int]]] = []  # drafts made right after a catch-up over skipped positions
    propose = proposer.propose

    def recording(items):
        out = propose(items)
        resumed.extend((it.request.request_id, len(it.tokens), p.draft_ids) for it, p in zip(items, out, strict=True)
                       if it.k > 0 and it.upto - it.draft_computed >= 6)
        return out

    proposer.propose = recording
    out = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in out] == reference
    assert worker.lookahead.taken > 0  # plain steps were queued ahead
    if proposer.graphs is not None:
        assert proposer.graphs.width < 6  # so each resume took the eager catch-up, then the graph
    checked = _check_drafts_against_ttt(llm, {r.request_id: r for r in out}, resumed)
    assert checked[0] >= 4 and checked[1] > 0, checked
    _assert_free(llm)


def test_eagle_under_preemption_and_mixed_batch(tiny_model_dir, heads, reference):
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), kv_cache_tokens=96)
    sampled = [SamplingParams(temperature=1.0, max_tokens=20, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    res = llm.generate(PROMPTS * 2, greedy_params() + sampled)
    assert [r.outputs[0].token_ids for r in res[: len(PROMPTS)]] == reference
    assert sum(r.spec_stats.accepted for r in res) > 0
    _assert_free(llm)


@pytest.mark.parametrize("temperature", [1.0, 0.5])  # dense q above the greedy threshold, one-hot below
def test_end_to_end_eagle_sampling_matches_target_distribution(tiny_model_dir, heads, temperature):
    n = 3000
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
              num_speculative_tokens=3, max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.encode_prompt("Once upon a time")
    params = [SamplingParams(temperature=temperature, max_tokens=4, seed=s, ignore_eos=True) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0 and sum(r.spec_stats.drafted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, 0, 1.0, 0.0))
    _assert_free(llm)


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory, tiny_tokenizer) -> Path:
    """A target whose next token depends on the current one only (attention off): learnable by a tiny head."""
    path = build_model(tmp_path_factory.mktemp("bigram"), seed=0, tokenizer=tiny_tokenizer, weight_scale=8.0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(path)
    return path


def test_training_lowers_loss_and_raises_tau(bigram_target, tmp_path):
    from streamsd.cli import build_parser
    from streamsd.train import cli as train_eagle

    prompts = tmp_path / "prompts.jsonl"
    words = " ".join(CORPUS[:6]).split()
    prompts.write_text("\n".join(json.dumps({"turns": [" ".join(words[i : i + 5 + i % 4]), "x"]})
                                 for i in range(0, 2 * 40, 2)))
    out = tmp_path / "head"
    args = build_parser().parse_args(["train-draft", "--model", str(bigram_target), "--out", str(out), "--prompts",
                                      str(prompts), "--num-prompts", "32", "--eval-prompts", "8", "--max-new-tokens",
                                      "40", "--epochs", "15", "--lr", "1e-2", "--no-self-prompts", "--threads", "1"])
    assert args.func is train_eagle.run and args.func(args) == 0
    meta = json.loads((out / "training.json").read_text())
    report = json.loads((out / "eval_report.json").read_text())
    first, last = meta["train"]["first"][0]["loss"], meta["train"]["last"][-1]["loss"]
    assert last < 0.5 * first
    # Answers kept out of training: the bigram target is learnable, so the head drafts them well too.
    assert meta["validation"]["answers"] >= 1 and meta["validation"]["match_0"] > 0.5, meta["validation"]
    untrained = save_head(new_head(_target(bigram_target)), tmp_path / "untrained", _config(bigram_target))
    before = evaluate(str(bigram_target), untrained, meta["held_out"], 40, 4, None, 0)
    tau_before, tau_after = before["results"]["T=0"]["tau"], report["results"]["T=0"]["tau"]
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    assert report["results"]["T=0.7"]["tau"] > before["results"]["T=0.7"]["tau"]
    assert len(report["results"]["T=0"]["accept_rate_at_depth"]) == 4


def test_train_draft_defaults_follow_the_device():
    """Unset settings take the device's defaults (on CUDA the shipped head's recipe); given ones stay."""
    from streamsd.cli import build_parser
    from streamsd.train.cli import DEFAULTS, apply_defaults

    for cuda, key in ((True, "cuda"), (False, "cpu")):
        args = build_parser().parse_args(["train-draft", "--model", "m", "--out", "o", "--lr", "5e-4"])
        apply_defaults(args, cuda)
        assert args.lr == 5e-4
        assert {k: getattr(args, k) for k in DEFAULTS[key] if k != "lr"} == {k: v for k, v in DEFAULTS[key].items()
                                                                             if k != "lr"}


def test_samples_cache_trains_a_second_head_on_the_same_answers(bigram_target, tmp_path):
    """`--samples-cache`: the first run answers and saves, the second reads the very same answers
    and streams back (no generation) and trains another head on them."""
    from streamsd.cli import build_parser

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(CORPUS[i % 6].split()[:6])}) for i in range(24)))
    cache = tmp_path / "samples.pt"
    common = ["--model", str(bigram_target), "--prompts", str(prompts), "--num-prompts", "20", "--eval-prompts", "4",
              "--max-new-tokens", "16", "--epochs", "1", "--no-self-prompts", "--threads", "1", "--no-eval",
              "--samples-cache", str(cache)]
    runs = []
    for name, extra in (("a", []), ("b", ["--norm-before-residual"])):
        args = build_parser().parse_args(["train-draft", "--out", str(tmp_path / name), *common, *extra])
        assert args.func(args) == 0 and cache.is_file()
        assert not (tmp_path / name / "eval_report.json").exists()
        runs.append(json.loads((tmp_path / name / "training.json").read_text()))
    first, second = runs
    assert second["data"]["answer_tokens"] == first["data"]["answer_tokens"] > 0
    assert second["seconds"]["generate"] == first["seconds"]["generate"]  # read back, not generated again
    assert second["held_out"] == first["held_out"] and second["validation"]["answers"] == first["validation"]["answers"]
    # "auto" (a): the tiny target's streams are nowhere near SmolLM2's ~2e4, so the residual starts from fc;
    # the bare flag (b) turns it on.
    assert first["stream_peak"] < 1e3 and not first["norm_before_residual"] and second["norm_before_residual"]
    assert _config(tmp_path / "b")["norm_before_residual"] and not _config(tmp_path / "a")["norm_before_residual"]
    # Answers of one target do not train another's head: refused with the reason, nothing written.
    other = build_model(tmp_path / "other", seed=3, hidden=32, heads=2, kv_heads=1, intermediate=64)
    args = build_parser().parse_args(["train-draft", "--out", str(tmp_path / "c"), *common, "--model", str(other)])
    assert args.func(args) == 2 and not (tmp_path / "c").exists()


def test_mismatched_heads_are_refused(tiny_model_dir, tiny_draft_dir, heads, tmp_path):
    import shutil

    with pytest.raises(ModelLoadError, match="hidden states of size 64, the target's are 32"):
        LLM(str(tiny_draft_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]))
    target = _target(tiny_model_dir)
    for change, message in [({"vocab_size": 500}, "vocabulary of 500 tokens"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "layers \\[0, 1, 9\\]"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}, "fc takes 192 inputs")]:
        bad = tmp_path / message[:6].replace(" ", "_")
        shutil.copytree(heads["eagle3"], bad)
        (bad / "config.json").write_text(json.dumps({**_config(heads["eagle3"]), **change}))
        with pytest.raises(ModelLoadError, match=message):
            load_head(bad, target, CPU, torch.float32)
    with pytest.raises(ModelLoadError, match="no EAGLE head is shipped"):
        LLM(str(tiny_model_dir), speculative_method="eagle")


def test_prompt_sources(tmp_path, tiny_tokenizer):
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"turns": ["first turn", "second"]}\n\n{"prompt": "a prompt"}\n')
    text = tmp_path / "q.txt"
    text.write_text("one line\n\nanother line\n")
    assert read_prompts(jsonl) == ["first turn", "a prompt"] and read_prompts(text) == ["one line", "another line"]
    assert user_prefix(tiny_tokenizer) == "<|im_start|>user\n"
    assert is_degenerate("the the the the the the") and is_degenerate("hi") and is_degenerate("<|im_end|> x y z")
    assert not is_degenerate("Write a short poem about the sea and its colours.")


def test_adaptive_k_keeps_eagle_exact(tiny_model_dir, heads, reference):
    # k changes per step (0 included): the head still catches up on every verified token.
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
              speculation_policy="adaptive")
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    _assert_free(llm)


def test_adaptive_k_keeping_no_streams_while_plain_stays_exact(tiny_model_dir, heads, reference):
    """The adaptive policy's plain steps write no streams at all (keep_streams_steps 0): every head
    resuming has the target recompute what it skipped, and greedy answers stay the target's."""
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]),
              speculation_policy="adaptive")
    policy = llm.core.scheduler.policy
    assert isinstance(policy, AdaptivePolicy)
    policy.keep_streams_steps = 0
    restore, restored = llm.core.rt.worker.restore_streams, []

    def counting(work):
        restored.extend(it.request.request_id for _, it in work if it.request.streams_missing_from is not None)
        restore(work)

    llm.core.rt.worker.restore_streams = counting
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    print(f"{len(restored)} catch-ups over unkept streams")
    _assert_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eagle_greedy_is_exact_through_graphs(tiny_model_dir, heads):
    """On CUDA the target's verify steps replay graphs that also return the head's streams (and the
    fast forward computes them in eager steps): greedy eagle still equals plain decoding."""
    # A small KV cache each: a CUDA engine's default takes most of the free memory, four would not fit.
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=4096)
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, greedy_params())]
    for kind in ("eagle3", "eagle1", "eagle3_norm_first"):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), device="cuda",
                  dtype="float32", kv_cache_tokens=4096)
        assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy_params())] == want
        worker = llm.core.rt.worker
        assert worker.graphs.hidden_layers == worker.proposer.hidden_layers and worker.graphs.replays > 0
        assert worker.target.fast is not None
        assert worker.verifier.graph_greedy > 10  # verified by the graph itself (sample/greedy.py)
        _assert_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "eagle3_norm_first"])
def test_cuda_eagle_graph_drafts_equal_eager_drafts(tiny_model_dir, heads, kind):
    """A propose call as one replay (catch-up + greedy draft chain, spec_decode/eagle/graphs.py) drafts what the
    eager head drafts: the same drafted and accepted counts at every depth, for every request, and
    the plain output. Near the end of an answer k is capped by the tokens left, so rows that want
    fewer drafts than the graph makes run too (their surplus steps write to the scratch block)."""
    plain = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=8192)
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, greedy_params())]
    stats = {}
    for graphs in (True, False):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]), device="cuda",
                  dtype="float32", kv_cache_tokens=8192)
        proposer = llm.core.rt.worker.proposer
        assert proposer.graphs is not None
        if not graphs:
            proposer.graphs = None
        res = llm.generate(PROMPTS, greedy_params())
        assert [r.outputs[0].token_ids for r in res] == want
        stats[graphs] = [(r.spec_stats.drafted, r.spec_stats.accepted, list(r.spec_stats.accepted_per_pos))
                         for r in res]
        if graphs:  # the head on the fused kernels, mostly queued behind the verify (chained)
            assert proposer.graphs.chained > 0 and proposer.fast is not None
            assert len({k[1] for k in proposer.graphs.graphs}) > 1
        _assert_free(llm)
    assert stats[True] == stats[False] and sum(s[1] for s in stats[True]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eagle_sampled_graph_drafts_equal_eager_drafts(tiny_model_dir, heads):
    """Sampled drafts inside the graph (each row warped at its own parameters, the keyed race, q into the
    request's pool slot) are the eager DraftPicker's: the same seeds give the same outputs and the same
    accepted counts with and without the graphs, in a batch mixing T = 1, top-k + top-p + min-p (the
    SORTED graph) and greedy requests. The rejection sampler reads those q: a wrong one would change
    which drafts pass."""
    from streamsd.spec_decode.eagle.graphs import GREEDY

    kinds = [dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05), dict(temperature=0.0)]
    params = [SamplingParams(max_tokens=n, seed=100 + i, ignore_eos=True, **kinds[i % 3])
              for i, n in enumerate(MAX_TOKENS)]
    runs = {}
    for graphs in (True, False):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cuda",
                  dtype="float32", kv_cache_tokens=8192)
        proposer = llm.core.rt.worker.proposer
        if not graphs:
            proposer.graphs = None
        res = llm.generate(PROMPTS, params)
        runs[graphs] = [(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res]
        if graphs:
            assert any(mode != GREEDY for _, _, mode in proposer.graphs.graphs) and proposer.graphs.chained > 0
        _assert_free(llm)
    assert runs[True] == runs[False]
    assert sum(r[2] for r in runs[True]) > 0 and sum(r[1] - r[2] for r in runs[True]) > 0


def test_graph_chain_steps_write_only_where_a_draft_is_wanted(tiny_model_dir, heads):
    """The chain layouts the graph works out on the device: step j of a row that wants more than
    j + 1 drafts writes its head slot at (first draft's position - 1 + j) in its own blocks, shifted by
    the accepted count a chained call leaves on the device; a row that wants fewer writes to the
    scratch block (its KV past its reservation is not its own), and so do the bucket's padding rows."""
    from streamsd.spec_decode.eagle.graphs import GREEDY, EagleGraphs

    head = load_head(heads["eagle3"], _target(tiny_model_dir), CPU, torch.float32)
    graphs = EagleGraphs(head, None, 16, scratch=9, max_blocks=8, width=5, stream_dtype=torch.float32, device=CPU)
    g = graphs._load((4, 4, GREEDY), [1, 2, 3], [17, 5], [2, 1], [[3, 4], [5]], np.array([1, 2]), [20, 7],
                     [4, 1], None)
    for accepted in (0, 2):
        g.accepted[:2] = torch.tensor([accepted, 0])
        layouts = graphs.chain_layouts(g)  # [J, 3, B]
        assert layouts.shape == (3, 3, 4)
        for j in range(3):
            pos0 = 19 + accepted + j
            positions, slots, ctx = layouts[j].tolist()
            assert positions[0] == pos0 and slots[0] == 4 * 16 + pos0 % 16 and ctx[0] == pos0 + 1
            assert slots[1] // 16 == 9 and all(s // 16 == 9 for s in slots[2:])  # row 1 wants 1 draft: no chain
            assert positions[1:] == [0, 0, 0] and ctx[1:] == [1, 1, 1]  # they attend to a first slot only


def _tensor_layout(layout):
    """A graph's layout (its host lists are placeholders) with host lists read from its tensors, so the
    CPU reference attention can run what the graph body computes."""
    from streamsd.model.kv_cache import BatchLayout

    ctx, qs = layout.context_lens_t.tolist(), layout.query_starts_t.tolist()
    lens = [b - a for a, b in zip(qs, qs[1:], strict=False)]
    tables = [row[: -(-c // 16)] if c else [] for row, c in zip(layout.block_table.tolist(), ctx, strict=False)]
    return BatchLayout(layout.positions, layout.slot_mapping, qs[:-1], lens, ctx, tables, layout.block_table,
                       layout.context_lens_t, layout.query_starts_t)


def _chained_engine(model_dir, head_dir, k: int = 4, past_max_tokens: bool = False, **kwargs) -> LLM:
    """An eagle engine whose propose calls run the graph bodies eagerly on the CPU (no capture), so the
    worker's chained path (the head queued behind the verify) runs here as it does on CUDA.
    `past_max_tokens`: near max_tokens requests keep the batch's k, as where chained steps queue ahead
    (SchedulerConfig.drafts_past_max_tokens; pipeline=True sets it): a reference for such an engine."""
    from streamsd.spec_decode.eagle.graphs import EagleGraphs

    llm = LLM(str(model_dir), speculative_method="eagle", draft_model=str(head_dir), num_speculative_tokens=k, **kwargs)
    if past_max_tokens:
        sched = llm.core.scheduler
        sched.cfg = dataclasses.replace(sched.cfg, drafts_past_max_tokens=True)
    worker = llm.core.rt.worker
    proposer = worker.proposer

    def run_layer(ids, feats, layout):
        return proposer.head.run_layer(ids, feats, layout.positions, proposer._attend(_tensor_layout(layout)))

    proposer.graphs = EagleGraphs(proposer.head, run_layer, worker.cache.block_size, worker.cache.data.shape[2] - 1,
                                  max_blocks=64, width=k + 1, stream_dtype=torch.float32, device=CPU,
                                  q_pool=proposer.q_pool)
    return llm


@pytest.mark.parametrize("kind,policy", [("eagle3", "fixed"), ("eagle1", "fixed"), ("eagle3", "adaptive")])
def test_chained_drafts_equal_drafts_proposed_after_the_read(tiny_model_dir, heads, reference, kind, policy):
    """The head queued straight behind the verify (catching up on every verified row, rejected ones
    included, and drafting from the row the device's accepted count picks; rows with fewer drafts
    than others packed like the target's streams) drafts what the head proposing after the host read
    drafts, eagerly or through the graph body (`run`): the same output, drafted and accepted counts at
    every depth, for every request; greedy output equal to the target's; nothing leaked. The adaptive
    policy gives steps whose requests verify different numbers of drafts (its k follow timings, so
    there only the output and the cleanup are compared)."""
    eager = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads[kind]),
                speculation_policy=policy)
    after_read = _chained_engine(tiny_model_dir, heads[kind], speculation_policy=policy)
    after_read.core.rt.worker._chain = lambda entries, hidden: None  # every propose call through `run`
    chained = _chained_engine(tiny_model_dir, heads[kind], speculation_policy=policy)
    counts = []
    graphs = chained.core.rt.worker.proposer.graphs
    run_chained = graphs.run_chained
    graphs.run_chained = lambda *a, **kw: counts.append(a[5]) or run_chained(*a, **kw)
    runs = []
    for llm in (eager, after_read, chained):
        res = llm.generate(PROMPTS, greedy_params())
        assert [r.outputs[0].token_ids for r in res] == reference
        runs.append([(r.spec_stats.drafted, r.spec_stats.accepted, list(r.spec_stats.accepted_per_pos)) for r in res])
        _assert_free(llm)
    assert after_read.core.rt.worker.proposer.graphs.replays > 0 and graphs.chained == len(counts) > 0
    assert any(len(set(c)) > 1 for c in counts)  # some steps verified different numbers of drafts per request
    if policy == "fixed":
        assert runs[0] == runs[1] == runs[2]
        assert sum(r[1] for r in runs[0]) > 0 and sum(r[0] - r[1] for r in runs[0]) > 0


def test_chained_sampled_drafts_equal_drafts_proposed_after_the_read(tiny_model_dir, heads):
    """Sampled drafts behind the verify: their noise is keyed by positions the device's accepted count
    sets, their q goes to the pool the next verify reads; the same seeds give the same outputs and
    counts as proposing after the read, in a batch mixing T = 1, top-k + top-p + min-p and greedy."""
    kinds = [dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05), dict(temperature=0.0)]
    params = [SamplingParams(max_tokens=n, seed=100 + i, ignore_eos=True, **kinds[i % 3])
              for i, n in enumerate(MAX_TOKENS)]
    runs = []
    for llm in (LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"])),
                _chained_engine(tiny_model_dir, heads["eagle3"])):
        res = llm.generate(PROMPTS, params)
        runs.append([(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res])
        _assert_free(llm)
    assert runs[0] == runs[1]
    assert sum(r[2] for r in runs[0]) > 0 and sum(r[1] - r[2] for r in runs[0]) > 0


def test_recorded_streams_equal_a_second_pass_also_after_preemption_and_a_deadline(tiny_model_dir):
    """`answer` keeps the streams its generating forwards computed: they equal a separate prefill pass
    over each answer, with preemption by recompute in between (a small KV pool), and when a deadline
    cuts the answers short (partial answers are kept, every request is freed). The forward hands its
    streams over in one reused buffer, as a CUDA graph's static output does: what `answer` keeps must
    be its own copy. Pipelining is on, as on CUDA: no step may run ahead of the recorder."""
    import time

    from streamsd.train.data import answer

    prompts = [" ".join(CORPUS[i].split()[:6]) for i in range(6)]
    llm = LLM(str(tiny_model_dir), max_num_seqs=4, kv_cache_tokens=160, pipeline=True, enable_prefix_caching=False)
    worker, static = llm.core.rt.worker, torch.empty(4096, 3 * 64)
    forward = worker.full.forward
    taken = worker.lookahead.taken  # by the start-up's warm-up requests

    def graph_like(entries):
        logits, hidden = forward(entries)
        static[: hidden.shape[0], : hidden.shape[1]] = hidden
        return logits, static[: hidden.shape[0], : hidden.shape[1]]

    worker.full.forward = graph_like  # type: ignore[method-assign]
    target, sched = llm.core.rt.worker.target, llm.core.scheduler
    preempted = []
    preempt = sched._preempt
    sched._preempt = lambda r: (preempted.append(r.request_id), preempt(r))[1]  # counts, then preempts
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="enable_prefix_caching"):  # a cached prefix's streams were never computed
        answer(LLM(str(tiny_model_dir)), prompts, 4, 0, (0.0,), (0, 1), dtype=torch.float32)
    full = answer(llm, prompts, 40, 0, (0.0, 1.0), (0, 1), dtype=torch.float32)
    elapsed = time.monotonic() - t0
    assert preempted and len(full) == len(prompts)
    cut = answer(llm, prompts, 40, 0, (0.0, 1.0), (0, 1), dtype=torch.float32,
                 deadline=time.monotonic() + elapsed / 8)
    _assert_free(llm)
    assert 0 < sum(len(s.ids) for s in cut) < sum(len(s.ids) for s in full)
    assert worker.lookahead.taken == taken
    for got in full + cut:
        ref = Sample(got.ids, got.prompt_len)
        attach_streams(target, [ref], (0, 1), dtype=torch.float32)  # the final stream: layer 2's output
        assert got.streams.shape == (len(got.ids), 2 * 64) and got.final.shape == (len(got.ids), 64)
        assert torch.allclose(got.streams, ref.streams, atol=1e-4) and torch.allclose(got.final, ref.final, atol=1e-4)


def test_in_waves_admits_a_quarter_batch_at_a_time(tiny_model_dir):
    """train-draft's driver: the batch fills, then new requests wait until a quarter of it is free and
    come in together (so most steps are decode-only graph replays); every request finishes once."""
    from streamsd.train.waves import in_waves

    llm = LLM(str(tiny_model_dir), max_num_seqs=8)
    core = llm.core
    live_at_admission: list[int] = []
    real_add = core.add_request

    def add(rid, prompt_ids, params):
        live_at_admission.append(len(core.scheduler.running) + len(core.scheduler.waiting))
        return real_add(rid, prompt_ids, params)

    core.add_request = add
    requests = [(f"w{i}", [5, 6, 7 + i % 9], SamplingParams(max_tokens=3 + i % 7, ignore_eos=True)) for i in range(30)]
    finished = [o.request_id for o in in_waves(core, requests) if o.finished]
    assert sorted(finished) == sorted(r for r, _, _ in requests)
    assert live_at_admission[:8] == list(range(8))  # the first fill
    # Later admissions start only with a quarter (2) of the 8 slots free.
    starts = [n for prev, n in zip(live_at_admission[7:], live_at_admission[8:], strict=False) if n <= prev]
    assert starts and all(n <= 6 for n in starts)
    _assert_free(llm)


def test_self_written_prompts_start_from_varied_openers(tiny_model_dir, tiny_tokenizer):
    """The target writes user turns after the chat template's user prefix and, in turn, after each
    opener; what it writes is kept with its opener, unless unfinished, degenerate or empty."""
    from streamsd.train.prompts import self_prompts, written_prompt

    assert written_prompt("Imagine you are", " a pilot landing in fog. What do you say?", "stop") == \
        "Imagine you are a pilot landing in fog. What do you say?"
    assert written_prompt("Imagine you are", " a", "stop") is None  # the opener alone is no request
    assert written_prompt("", "Tell me about the sea and its colours.", "length") is None  # unfinished
    assert written_prompt("", "Tell me about the sea and its colours.", "stop") is not None
    llm = LLM(str(tiny_model_dir))
    seen: list[str] = []
    real_add = llm.core.add_request

    def recording_add(rid, prompt_ids, params):  # the real engine; only its inputs are noted
        seen.append(tiny_tokenizer.decode(prompt_ids))
        return real_add(rid, prompt_ids, params)

    llm.core.add_request = recording_add
    openers = ("Write a Python function that", "Imagine you are", "")
    self_prompts(llm, 2, seed=3, avoid=set(), max_tokens=8, openers=openers)
    assert len(seen) >= 6
    prefix = user_prefix(tiny_tokenizer)
    for i, text in enumerate(seen[:6]):
        assert text.startswith(prefix) and text[len(prefix):].strip() == openers[i % 3]


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_chained_steps_queued_ahead_change_nothing(tiny_model_dir, heads, reference, kind):
    """An EAGLE verify queued before the step before it is read (worker/lookahead.py: its ids, starts,
    noise positions and drafts all from the device): greedy output equal to the target's; greedy and
    sampled drafts (T = 1, top-k + top-p + min-p, min_tokens, EOS allowed) give the same tokens and
    per-request drafted / accepted counts as the engine that reads each step first; queued steps
    were really taken; nothing leaked."""
    ahead = _chained_engine(tiny_model_dir, heads[kind], pipeline=True)
    cfg = ahead.core.scheduler.cfg
    assert (cfg.drafting_reserve, cfg.drafting_keep) == (5, 15)  # k = 4: the verify queued behind, its reach
    la = ahead.core.rt.worker.lookahead
    taken = la.taken  # by the start-up's warm-up requests
    assert [r.outputs[0].token_ids for r in ahead.generate(PROMPTS[:1], greedy_params()[:1])] == reference[:1]
    assert la.taken >= taken + 1, (la.taken, la.dropped)
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05)]
    runs = []
    for llm in (_chained_engine(tiny_model_dir, heads[kind], past_max_tokens=True), ahead):
        out = []
        for i, kw in enumerate(kinds):  # batch 1: every step of the answer can be queued ahead
            p = SamplingParams(max_tokens=60, seed=100 + i, min_tokens=3 * i, **kw)
            out += [(r.outputs[0].token_ids, r.outputs[0].finish_reason, r.spec_stats.drafted, r.spec_stats.accepted)
                    for r in llm.generate(PROMPTS[i:i + 1], p)]
        res = llm.generate(PROMPTS * 2, [SamplingParams(max_tokens=40, seed=i, **kinds[i % 3]) for i in range(12)])
        runs.append(out + [(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res])
        _assert_free(llm)
    assert runs[0] == runs[1]
    assert la.taken >= taken + 15 and sum(r[-1] for r in runs[0]) > 0, (la.taken, la.dropped)


def test_chained_steps_stay_queued_up_to_max_tokens(tiny_model_dir, heads, reference):
    """Where chained steps queue ahead, a request near max_tokens keeps the batch's k
    (SchedulerConfig.drafts_past_max_tokens): its drafts past the end are free in a graph padded to the
    widest request, and what they accept past it is cut. So its last steps are queued ones too, where
    otherwise none is from 2(k + 1) tokens before its end. The answers stay the target's, the queued
    step left behind by the last request is dropped, nothing leaks (test_lookahead.py has the
    scheduler's side: the k kept, the drafts counted)."""

    counts: dict[bool, tuple[int, int]] = {}

    def run(past: bool) -> tuple[LLM, list]:
        llm = _chained_engine(tiny_model_dir, heads["eagle3"], pipeline=True)
        sched, la = llm.core.scheduler, llm.core.rt.worker.lookahead
        counts[past] = la.taken, la.dropped  # the start-up's warm-up requests'
        assert sched.cfg.drafts_past_max_tokens and la.past_max_tokens_within == sched.cfg.max_model_len
        if not past:
            sched.cfg = dataclasses.replace(sched.cfg, drafts_past_max_tokens=False)
            la.past_max_tokens_within = None
        out = []
        for prompt, params in zip(PROMPTS, greedy_params(), strict=True):  # batch 1: every step may queue
            out += llm.generate([prompt], params)
        assert la.queued is None
        _assert_free(llm)
        return llm, out

    (on, got), (off, want) = run(True), run(False)
    assert [r.outputs[0].token_ids for r in got] == reference == [r.outputs[0].token_ids for r in want]
    la_on, la_off = on.core.rt.worker.lookahead, off.core.rt.worker.lookahead
    steps = sum(r.spec_stats.steps for r in got)
    # Every step of each answer but its first two (its prompt, then the first verify: nothing queued
    # before them) was a queued one, to its last; the step queued behind each answer's last one was
    # dropped (forget_finished).
    taken_on, dropped_on = la_on.taken - counts[True][0], la_on.dropped - counts[True][1]
    assert (taken_on, dropped_on) == (steps - 2 * len(PROMPTS), len(PROMPTS)), (steps, taken_on)
    assert la_off.taken - counts[False][0] < taken_on - len(PROMPTS), (la_off.taken, taken_on)
    assert [r.spec_stats.emitted for r in got] == MAX_TOKENS


def test_dropped_queued_chains_leave_the_next_verify_intact(tiny_model_dir, heads):
    """Requests joining mid-answer drop the verify queued ahead (its plan no longer fits): the
    dropped step's drafts and their q (sampled drafts, T = 1) must not reach the verify that
    replaces it; the output and counts equal the engine that never queues ahead."""

    def drive(llm: LLM) -> tuple[dict, int]:
        core, got = llm.core, {}
        core.add_request("a", core.encode_prompt(PROMPTS[0]), SamplingParams(temperature=1.0, max_tokens=80, seed=3))
        for n, turn in enumerate(core.run()):
            if n in (6, 12, 20):
                core.add_request(f"j{n}", core.encode_prompt(PROMPTS[n % 6]),
                                 SamplingParams(temperature=1.0, max_tokens=30, seed=n))
            for o in turn.outputs:
                got.setdefault(o.request_id, []).extend(o.token_ids)
        _assert_free(llm)
        return got, core.totals.accepted

    ahead = _chained_engine(tiny_model_dir, heads["eagle3"], pipeline=True)
    assert drive(ahead) == drive(_chained_engine(tiny_model_dir, heads["eagle3"], past_max_tokens=True))
    la = ahead.core.rt.worker.lookahead
    assert la.dropped >= 3 and la.taken >= 5, (la.taken, la.dropped)
    # Directly: the replacing verify reads the q rows the queued one read (the last read step's).
    core, worker = ahead.core, ahead.core.rt.worker
    a = core.add_request("q", core.encode_prompt(PROMPTS[1]), SamplingParams(temperature=1.0, max_tokens=60, seed=9))
    seen: list[tuple[bool, torch.Tensor]] = []
    launch = worker.verifier.launch

    def spy(entries, *args, **kw):
        if a.q_slot is not None:
            seen.append(("positions" in kw, worker.verifier.q_pool[a.q_slot].clone()))  # before its chain drafts
        return launch(entries, *args, **kw)

    worker.verifier.launch = spy
    while la.queued is None:
        core.step()
    core.add_request("late", core.encode_prompt(PROMPTS[2]), SamplingParams(temperature=1.0, max_tokens=5, seed=1))
    core.step()  # a prompt chunk joins: the queued verify is dropped, the real one launches
    worker.verifier.launch = launch
    assert la.queued is None and seen[-2][0] and not seen[-1][0]
    assert torch.equal(seen[-1][1], seen[-2][1])
    while core.has_work:
        core.step()
    _assert_free(ahead)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_chained_steps_queued_ahead_change_nothing(tiny_model_dir, heads):
    """On CUDA a verify queued ahead is built on the device (graphs.restart: positions, slots and
    context lengths from starts the host does not know yet): greedy and sampled answers, drafted and
    accepted counts equal the engine that reads each step before queueing the next."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05)]
    runs = []
    for pipeline in (False, True):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cuda",
                  dtype="float32", kv_cache_tokens=8192, pipeline=pipeline)
        out = []
        for i, kw in enumerate(kinds):
            res = llm.generate(PROMPTS[i], SamplingParams(max_tokens=80, seed=i, **kw))
            res += llm.generate(PROMPTS, [SamplingParams(max_tokens=50, seed=j, **kw) for j in range(len(PROMPTS))])
            out += [(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res]
        runs.append(out)
        la = llm.core.rt.worker.lookahead
        assert (la.taken > 20) == pipeline, (la.taken, la.dropped)
        _assert_free(llm)
    assert runs[0] == runs[1]


def test_drafts_are_counted_alike_pipelined_or_not(tiny_model_dir, heads):
    """A pipelined EAGLE engine verifies whole chains up to max_tokens (drafts_past_max_tokens); one that
    reads each step first cuts them. Drafts that could never be emitted, or only where the bonus token
    would have been anyway, count for neither: the same drafted and accepted counts, request by request."""
    runs = []
    for pipeline in (False, True):
        llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cpu",
                  dtype="float32", kv_cache_tokens=8192, pipeline=pipeline)
        assert llm.core.rt.scheduler_config.drafts_past_max_tokens == pipeline
        res = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=n, seed=0, temperature=0.0) for n in (80, 37)])
        runs.append([(r.outputs[0].token_ids, r.spec_stats.drafted, r.spec_stats.accepted) for r in res])
    assert runs[0] == runs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_are_captured_before_the_first_request(tiny_model_dir, heads):
    """A fixed-k EAGLE engine (no start-up profile) has every graph it will replay captured and every
    kernel compiled when it is built: requests at batch 1 and 3, greedy and sampled, running into their
    max_tokens (drafts cut step by step) capture and compile nothing. On the H200 the first such request
    captured graphs and compiled inside its last steps, 1.3-1.5 s each."""
    from streamsd.kernels.warmup import compiled_variants

    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]), device="cuda",
              dtype="float32", kv_cache_tokens=4096, max_num_seqs=4, speculation_policy="fixed")
    worker = llm.core.rt.worker

    def counts() -> tuple[int, int, int]:
        return len(worker.graphs.graphs), len(worker.proposer.graphs.graphs), compiled_variants()

    before = counts()
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_k=20, top_p=0.8)]
    for i, kw in enumerate(kinds):
        llm.generate(PROMPTS[i], SamplingParams(max_tokens=13 + i, seed=i, ignore_eos=True, **kw))
        llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=9 + j, seed=j, ignore_eos=True, **kw) for j in range(3)])
    assert counts() == before
    _assert_free(llm)
