"""`streamsd bench` datasets (bench/datasets.py): MT-Bench, ShareGPT, random and shared-prefix prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import streamsd
from streamsd.bench.client import RequestSpec, sampling_fields
from streamsd.bench.datasets import load_dataset, load_mt_bench, load_sharegpt, random_prompts, shared_prefix
from tests.bench.bench_helpers import MT_BENCH


def test_mt_bench_first_turns(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["first?", "second?"]}\n\n{"turns": []}\n{"turns": ["b"]}\n')
    assert [p.text for p in load_mt_bench(path)] == ["first?", "b"]
    assert [p.follow_up for p in load_mt_bench(path)] == ["second?", None]
    if MT_BENCH.is_file():
        prompts = load_dataset(str(MT_BENCH), 100)
        assert len(prompts) == 100 and prompts[0].text.startswith("Compose an engaging travel blog")
        assert prompts[80].text == prompts[0].text  # 80 questions, cycled


def test_shipped_chat_prompts_load_as_mt_bench_questions_with_follow_ups() -> None:
    path = Path(streamsd.__file__).parent / "assets" / "bench" / "chat-prompts.jsonl"
    prompts = load_mt_bench(path)
    assert len(prompts) == 42 and len({p.text for p in prompts}) == 42
    assert all(p.follow_up for p in prompts)
    assert [p.text for p in load_dataset(str(path), 44)][42:] == [prompts[0].text, prompts[1].text]


def test_sharegpt_human_turn_and_output_len(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "a b c"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "Q"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    prompts = load_sharegpt(path)
    assert [(p.text, p.output_len) for p in prompts] == [("Hello there", 3), ("Q", None)]
    assert [p.text for p in load_dataset(str(path), 3)] == ["Hello there", "Q", "Hello there"]


def test_random_prompts_are_seeded_and_sized() -> None:
    a, b = random_prompts(4, 10, 7, seed=3), random_prompts(4, 10, 7, seed=3)
    assert a == b and len({p.text for p in a}) == 4
    assert all(len(p.text.split(": ", 1)[1].split()) == 10 and p.output_len == 7 for p in a)
    assert len(load_dataset("random:5", 2)[0].text.split()) == 6  # index prefix + 5 words
    with pytest.raises(FileNotFoundError):
        load_dataset("/nonexistent.jsonl", 1)


def test_shared_prefix_is_seeded_and_leads_every_prompt() -> None:
    assert shared_prefix(50, 3) == shared_prefix(50, 3) != shared_prefix(50, 4)
    assert len(shared_prefix(50, 3).split()) == 50
    chat = sampling_fields(RequestSpec("chat", "m", "Paris?", 8, system="Be brief."))
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    assert sampling_fields(RequestSpec("completions", "m", "Paris?", 8, system="Be brief."))["prompt"] == \
        "Be brief.\n\nParis?"
