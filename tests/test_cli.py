"""The command line itself: every option explains itself, and help comes without loading torch."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamsd.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    """(command path, action, subcommand help or None) for every action of every (sub)parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield path + (name,), None, helps.get(name)
                yield from _walk(sub, path + (name,))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action, None


def test_every_option_of_every_subcommand_has_a_help_line():
    missing = []
    for path, action, sub_help in _walk(build_parser(), ("streamsd",)):
        if action is None:
            if not sub_help:
                missing.append(" ".join(path) + " (the subcommand)")
        elif not (action.help or "").strip():
            missing.append(" ".join(path) + " " + ("/".join(action.option_strings) or action.dest))
    assert not missing, "options without help text:\n" + "\n".join(missing)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["bench", "offline", "--help"],
                                  ["generate", "--help"]])
def test_help_does_not_import_torch(argv):
    code = (f"import sys\nfrom streamsd.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('torch loaded:', 'torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: streamsd" in out.stdout
    assert out.stdout.strip().endswith("torch loaded: False"), out.stdout[-300:]


def test_exact_mode_on_cuda_drafts_chains_by_default_and_takes_a_tree_asked_for():
    """`--exact` on CUDA: the default model's head drafts chains unless a tree is named, which is taken
    (the exact mode verifies trees as it does chains)."""
    from streamsd.cli import build_parser
    from streamsd.engine.args import DEFAULT_MODEL, engine_config

    cfg = engine_config(build_parser().parse_args(["serve", "--device", "cuda", "--exact"]))
    assert cfg.exact and cfg.model == DEFAULT_MODEL and cfg.spec.method == "eagle" and cfg.spec.tree is None
    cfg = engine_config(build_parser().parse_args(["serve", "--device", "cuda", "--exact", "--speculative-tree",
                                                    "3,4,4,12"]))
    assert cfg.exact and str(cfg.spec.tree) == "3,4,4,12"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--device", "cuda"], True), (["--device", "cpu"], False),
    (["--device", "cuda", "--no-engine-process"], False), (["--device", "cpu", "--engine-process"], True),
])
def test_the_engine_runs_in_its_own_process_by_default_on_a_gpu_only(argv, expected):
    from streamsd.engine.args import engine_process

    a = build_parser().parse_args(["serve", *argv])
    assert engine_process(a.engine_process, a.device) is expected


def _config(*argv: str):
    from streamsd.engine.args import engine_config

    return engine_config(build_parser().parse_args(["serve", *argv]))


def test_vllms_speculative_config_maps_onto_the_speculation_flags():
    cfg = _config("--device", "cuda", "--speculative-config",
                  '{"method": "eagle3", "model": "heads/h", "num_speculative_tokens": 3}')
    assert (cfg.spec.method, cfg.spec.draft_model, cfg.spec.num_tokens, cfg.spec.tree) == ("eagle", "heads/h", 3, None)
    cfg = _config("--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert (cfg.spec.method, cfg.spec.num_tokens, cfg.spec.ngram_max, cfg.spec.ngram_min) == ("ngram", 5, 3, 2)
    cfg = _config("--speculative-config", '{"model": "drafts/small", "disable_by_batch_size": 8}')
    assert (cfg.spec.method, cfg.spec.draft_model, cfg.spec.max_batch) == ("draft", "drafts/small", 8)


@pytest.mark.parametrize(("value", "message"), [
    ("{", "is not JSON"),
    ("[1]", "must be a JSON object"),
    ('{"method": "medusa", "model": "m"}', "method 'medusa' not supported here"),
    ('{"method": "eagle"}', "needs a model"),
    ('{"method": "ngram", "quantization": "fp8"}', "quantization not supported here"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "eagle", "model": "h", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size must be 1"),
])
def test_a_speculative_config_streamsd_cannot_honour_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        _config("--speculative-config", value)


def test_a_speculative_config_beside_the_flags_it_sets_is_refused():
    with pytest.raises(ValueError, match="leave out --num-speculative-tokens"):
        _config("--num-speculative-tokens", "3", "--speculative-config", '{"method": "ngram"}')


def test_serve_takes_the_model_as_vllm_serve_does():
    from streamsd.cli import _model_tag

    a = _model_tag(build_parser().parse_args(["serve", "models/m", "--port", "9000"]))
    assert a.model == "models/m" and a.port == 9000
    assert _model_tag(build_parser().parse_args(["serve", "--model", "models/m", "models/m"])).model == "models/m"
    with pytest.raises(ValueError, match="two models"):
        _model_tag(build_parser().parse_args(["serve", "models/a", "--model", "models/b"]))


def test_the_http_clients_request_lines_show_at_debug_only():
    import logging

    from streamsd.cli import configure_logging

    httpx_log = logging.getLogger("httpx")
    level = httpx_log.level
    try:
        configure_logging("info")
        assert not httpx_log.isEnabledFor(logging.INFO)
        configure_logging("debug")
        assert httpx_log.isEnabledFor(logging.INFO)
    finally:
        httpx_log.setLevel(level)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_generate_streams_what_the_engine_decodes(tiny_model_dir, capsys, method):
    """`streamsd generate` prints the greedy text the offline engine decodes for the same prompt, then
    its summary line."""
    from streamsd.cli import main
    from streamsd.engine.llm import LLM
    from streamsd.request import SamplingParams

    flags = ["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32"]
    assert main(["generate", *flags, "--speculative-method", method, "--prompt", "the cat sat on",
                 "--max-tokens", "12", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32")
    (want,) = llm.generate("the cat sat on", SamplingParams(temperature=0, max_tokens=12))
    text, summary = printed.rsplit("\n[", 1)
    assert text == want.outputs[0].text
    assert summary.startswith(f"{len(want.outputs[0].token_ids)} tokens in ")
    assert summary.rstrip().endswith("(plain)]" if method == "none" else "(ngram)]")
