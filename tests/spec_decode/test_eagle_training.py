"""`train-draft`: loss and tau, defaults, the samples cache, prompts, recorded streams and waves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamsd import LLM, SamplingParams
from streamsd.model.tokenizer import read_tokenizer
from streamsd.spec_decode.eagle.checkpoint import new_head, save_head
from streamsd.train.data import Sample, attach_streams
from streamsd.train.eval import evaluate
from streamsd.train.prompts import is_degenerate, read_prompts, user_prefix
from tests.engine.engine_helpers import assert_free
from tests.spec_decode.eagle_helpers import tiny_config, tiny_target
from tests.tiny import CORPUS, build_model


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
    untrained = save_head(new_head(tiny_target(bigram_target)), tmp_path / "untrained", tiny_config(bigram_target))
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
    assert tiny_config(tmp_path / "b")["norm_before_residual"] and not tiny_config(tmp_path / "a")["norm_before_residual"]
    # Answers of one target do not train another's head: refused with the reason, nothing written.
    other = build_model(tmp_path / "other", seed=3, hidden=32, heads=2, kv_heads=1, intermediate=64)
    args = build_parser().parse_args(["train-draft", "--out", str(tmp_path / "c"), *common, "--model", str(other)])
    assert args.func(args) == 2 and not (tmp_path / "c").exists()


def test_prompt_sources(tmp_path, tiny_model_dir):
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"turns": ["first turn", "second"]}\n\n{"prompt": "a prompt"}\n')
    text = tmp_path / "q.txt"
    text.write_text("one line\n\nanother line\n")
    assert read_prompts(jsonl) == ["first turn", "a prompt"] and read_prompts(text) == ["one line", "another line"]
    assert user_prefix(read_tokenizer(tiny_model_dir)) == "<|im_start|>user\n"
    assert is_degenerate("the the the the the the") and is_degenerate("hi") and is_degenerate("<|im_end|> x y z")
    assert not is_degenerate("Write a short poem about the sea and its colours.")


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
    assert_free(llm)
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
    assert_free(llm)


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
    prefix = user_prefix(llm.tokenizer)
    for i, text in enumerate(seen[:6]):
        assert text.startswith(prefix) and text[len(prefix):].strip() == openers[i % 3]
