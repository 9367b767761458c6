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


def test_exact_mode_on_cuda_keeps_the_default_models_head_on_chains():
    """`--exact` verifies chains only: the default model's head on CUDA drafts a chain instead of its default
    tree, and a tree asked for by name is refused."""
    from streamsd.cli import DEFAULT_MODEL, _engine_config, build_parser

    cfg = _engine_config(build_parser().parse_args(["serve", "--device", "cuda", "--exact"]))
    assert cfg.exact and cfg.model == DEFAULT_MODEL and cfg.spec.method == "eagle" and cfg.spec.tree is None
    with pytest.raises(ValueError, match="exact mode verifies chains"):
        _engine_config(build_parser().parse_args(["serve", "--device", "cuda", "--exact", "--speculative-tree",
                                                  "4,6,6,24"]))
