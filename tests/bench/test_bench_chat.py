"""`streamsd bench chat` end to end on the CPU: tiny target, tiny trained EAGLE head, every method's
row per temperature, and greedy speculative answers equal to plain's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.cli import build_parser, main
from streamsd.spec_decode.eagle.checkpoint import new_head, save_head
from streamsd.train.data import Sample, attach_streams
from streamsd.train.loop import TrainConfig, train
from tests.tiny import CORPUS

HELD_OUT = CORPUS[:3]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def head_with_held_out(tiny_model_dir, tmp_path_factory) -> Path:
    """A head that has learnt the target's greedy answers to the prompts (so greedy drafts are accepted
    and exactness is put to the test), with the training.json `train-draft` writes beside it."""
    torch.manual_seed(0)
    llm = LLM(str(tiny_model_dir))
    convs = [[{"role": "user", "content": p}] for p in HELD_OUT]
    res = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    samples = [Sample(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids)) for r in res]
    target = llm.core.rt.worker.target
    head = new_head(target)
    attach_streams(target, samples, head.input_layers)
    train(head, target, samples, list(range(target.args.vocab_size)), TrainConfig(epochs=30, lr=1e-2, batch_tokens=1024))
    out = save_head(head, tmp_path_factory.mktemp("chat_head"), json.loads((tiny_model_dir / "config.json").read_text()),
                    torch.float32)
    (out / "training.json").write_text(json.dumps({"held_out": HELD_OUT}))
    return out


def _bench(out: Path, *extra: str) -> dict:
    args = build_parser().parse_args(["bench", "chat", "--device", "cpu", "--threads", "1", "--dtype", "float32",
                                      "--prompts", "2", "--max-tokens", "8", "--no-hf", "--output-json", str(out),
                                      *extra])
    assert args.func(args) == 0
    return json.loads(out.read_text())


def test_every_method_gets_a_row_per_temperature_and_greedy_speculation_answers_as_plain_does(
        tmp_path, tiny_model_dir, head_with_held_out, capsys):
    doc = _bench(tmp_path / "chat.json", "--model", str(tiny_model_dir), "--head", str(head_with_held_out),
                 "--methods", "plain,ngram,eagle", "--trees", "2,2,2,4", "--temperatures", "0,1")
    assert doc["prompts_from"] == str(head_with_held_out / "training.json")  # the head's own held-out prompts
    rows = {(r["method"], r["temperature"]): r for r in doc["rows"]}
    methods = ("plain", "ngram", "eagle", "tree-2,2,2,4")
    assert len(doc["rows"]) == len(rows) == 8 and set(rows) == {(m, t) for m in methods for t in (0.0, 1.0)}
    for r in doc["rows"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["vs_plain"] > 0 and len(r["answers"]) == 2
    plain = rows[("plain", 0.0)]
    assert plain["tau"] is None and plain["vs_plain"] == 1.0
    for m in methods[1:]:
        greedy = rows[(m, 0.0)]
        assert greedy["answers"] == plain["answers"] and greedy["same_as_plain"] == 2
        assert greedy["tau"] >= 1.0 and rows[(m, 1.0)]["same_as_plain"] is None
    assert rows[("eagle", 0.0)]["tau"] > 1.0 and rows[("tree-2,2,2,4", 0.0)]["tau"] > 1.0  # drafts were accepted
    table = capsys.readouterr().out
    assert "streamsd bench chat" in table and "tree-2,2,2,4" in table and "τ" in table


def test_in_the_exact_mode_seeded_speculative_answers_are_counted_and_equal_plain(
        tmp_path, tiny_model_dir, head_with_held_out, capsys):
    doc = _bench(tmp_path / "exact.json", "--model", str(tiny_model_dir), "--head", str(head_with_held_out),
                 "--methods", "plain,ngram,eagle", "--trees", "2,2,2,4", "--temperatures", "0,1", "--exact")
    rows = {(r["method"], r["temperature"]): r for r in doc["rows"]}
    assert doc["exact"] and len(rows) == 8
    for m in ("ngram", "eagle", "tree-2,2,2,4"):
        for t in (0.0, 1.0):
            assert rows[(m, t)]["same_as_plain"] == 2 and rows[(m, t)]["answers"] == rows[("plain", t)]["answers"]
    assert rows[("eagle", 0.0)]["tau"] > 1.0  # drafts were accepted (tests/model/test_exact_forward.py: sampled too)
    assert "exact mode" in capsys.readouterr().out


def test_a_dataset_replaces_the_held_out_prompts(tmp_path, tiny_model_dir):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in ("Tell me a story.", "Count to ten.")))
    doc = _bench(tmp_path / "d.json", "--model", str(tiny_model_dir), "--dataset", str(dataset),
                 "--methods", "plain,ngram", "--temperatures", "0")
    assert doc["prompts_from"] == str(dataset) and doc["prompts"] == 2
    assert [r["method"] for r in doc["rows"]] == ["plain", "ngram"]
    assert doc["rows"][1]["answers"] == doc["rows"][0]["answers"] and doc["rows"][1]["same_as_plain"] == 2


def test_bad_methods_and_missing_prompts_are_one_line_errors(tmp_path, tiny_model_dir, capsys):
    assert main(["bench", "chat", "--model", str(tiny_model_dir), "--methods", "plain,medusa"]) == 2
    assert "--methods: unknown medusa" in capsys.readouterr().err
    assert main(["bench", "chat", "--model", str(tiny_model_dir), "--held-out", str(tmp_path / "none.json")]) == 2
    assert "no held-out prompts" in capsys.readouterr().err
    assert main(["bench", "chat", "--model", str(tiny_model_dir)]) == 2  # no head shipped for it: no prompts either
    assert "give --head, --held-out or --dataset" in capsys.readouterr().err
