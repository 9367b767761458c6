"""`streamsd bench overhead`: the same engine in process and inside a real `streamsd serve` over SSE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamsd.bench.datasets import CHAT_PROMPTS, load_dataset
from streamsd.bench.overhead import engine_flags
from streamsd.cli import main
from tests.bench.bench_helpers import MT_BENCH
from tests.server_util import free_port


@pytest.mark.parametrize("process", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_both_sides_answer_alike_and_each_is_timed(tiny_model_dir: Path, tmp_path: Path, capsys, process) -> None:
    out = tmp_path / "overhead.json"
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("the cat sat", "a dog ran", "we sang")))
    flags = f"--model {tiny_model_dir} --device cpu --dtype float32 --speculative-method ngram"
    rc = main(["bench", "overhead", "--serve-args", flags, "--dataset", str(dataset), "--num-prompts", "3",
               "--max-tokens", "12", "--repeats", "2", "--port", str(free_port()), "--output-json", str(out), *process])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["serve_args"] == flags.split() and doc["max_tokens"] == 12
    assert doc["engine_process"] is bool(process)
    # float32 on a CPU: the server's engine and this process's one decode the same greedy tokens
    assert doc["requests"] == 6 and doc["identical"] == 6
    rows = doc["rows"]
    for side in ("engine", "server (SSE)"):
        assert rows[side]["ttft_ms"] > 0 and rows[side]["tpot_ms"] > 0
    assert rows["server adds"]["ttft_ms"] == pytest.approx(rows["server (SSE)"]["ttft_ms"] - rows["engine"]["ttft_ms"])
    printed = capsys.readouterr().out
    assert "server adds" in printed and "identical answers: 6 of 6" in printed


def test_the_default_prompts_are_held_out_from_mt_bench() -> None:
    texts = [p.text for p in load_dataset(str(CHAT_PROMPTS), 4)]
    assert len(set(texts)) == 4  # four different requests, not one file line cycled
    if MT_BENCH.is_file():  # the head's evaluation set, where the checkout has it
        assert not set(texts) & {p.text for p in load_dataset(str(MT_BENCH), 80)}


def test_the_flags_are_the_servers_engine_flags_only(capsys) -> None:
    flags, ns = engine_flags("--device cpu --speculative-tree 3,4,4,12 --no-enable-prefix-caching")
    assert flags == ["--device", "cpu", "--speculative-tree", "3,4,4,12", "--no-enable-prefix-caching"]
    assert ns.speculative_tree == "3,4,4,12" and not ns.enable_prefix_caching and ns.gpu_memory_utilization is None
    assert main(["bench", "overhead", "--serve-args", "--device cpu --port 9000"]) == 2
    assert "not --port 9000" in capsys.readouterr().err
    assert main(["bench", "overhead", "--serve-args", "--device cpu --dtype float8"]) == 2
    assert "--serve-args" in capsys.readouterr().err


def test_a_server_that_cannot_start_is_one_error_line_with_its_words(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["bench", "overhead", "--serve-args", f"--model {missing} --device cpu", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the server exited with") and "no-such-model" in err
