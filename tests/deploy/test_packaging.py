"""The wheel ships every package and the chat UI."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_for_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "streamsd").rglob("__init__.py")}
    assert found | {"streamsd.web"} == listed


def test_installed_ui_dir_has_the_page():
    from streamsd.cli import default_web_dir

    assert (default_web_dir() / "index.html").exists()


def test_default_speculation_follows_the_model_and_the_device():
    """The embedded default model speculates with its shipped EAGLE head on CUDA and with n-gram lookup
    on a CPU; a draft model given means draft; any other model speculates only when asked."""
    from streamsd.engine.args import DEFAULT_MODEL, default_speculation

    assert default_speculation(DEFAULT_MODEL, None, "cuda") == "eagle"
    assert default_speculation(DEFAULT_MODEL, None, "cpu") == "ngram"
    assert default_speculation(DEFAULT_MODEL, "some/draft", "cuda") == "draft"
    assert default_speculation("some/other-model", None, "cuda") == "none"


def test_default_model_on_cuda_drafts_trees_chosen_step_by_step():
    """`streamsd serve` with nothing said: on CUDA the default model's head drafts DEFAULT_TREE, each step a
    tree or a plain one as the step chooser prices them (the adaptive policy, no batch gate); a gate given
    makes it the fixed policy's; a chain setting asked for (policy, K), a tree given or 'none', another
    model or a CPU keep their own speculation."""
    from streamsd.cli import build_parser
    from streamsd.engine.args import DEFAULT_MODEL, DEFAULT_TREE, engine_config

    def spec(*argv: str):
        return engine_config(build_parser().parse_args(["serve", *argv])).spec

    cuda = spec("--device", "cuda")
    assert (cuda.method, str(cuda.tree), cuda.policy, cuda.max_batch) == ("eagle", DEFAULT_TREE, "adaptive", 0)
    assert cuda.num_tokens == 24 and DEFAULT_TREE.endswith(",24")
    gated_tree = spec("--device", "cuda", "--speculative-max-batch", "4")
    assert (str(gated_tree.tree), gated_tree.policy, gated_tree.max_batch) == (DEFAULT_TREE, "fixed", 4)
    for chain in (spec("--device", "cuda", "--speculation-policy", "adaptive"),
                  spec("--device", "cuda", "--speculative-tree", "none"),
                  spec("--device", "cuda", "--num-speculative-tokens", "3")):
        assert chain.method == "eagle" and chain.tree is None and chain.max_batch == 0
    assert spec("--device", "cuda", "--speculative-tree", "none").policy == "adaptive"
    gated_chain = spec("--device", "cuda", "--speculative-tree", "none", "--speculative-max-batch", "8")
    assert (gated_chain.tree, gated_chain.policy, gated_chain.max_batch) == (None, "fixed", 8)
    assert spec("--device", "cuda", "--speculative-tree", "none", "--speculative-max-batch", "0").policy == "adaptive"
    given = spec("--device", "cuda", "--speculative-tree", "3,8,8,24")
    assert (str(given.tree), given.policy, given.max_batch) == ("3,8,8,24", "adaptive", 0)
    fixed = spec("--device", "cuda", "--speculative-tree", "3,8,8,24", "--speculation-policy", "fixed")
    assert (str(fixed.tree), fixed.policy, fixed.max_batch) == ("3,8,8,24", "fixed", 0)
    cpu = spec("--device", "cpu")
    assert (cpu.method, cpu.tree, cpu.policy, cpu.max_batch) == ("ngram", None, "adaptive", 0)
    assert spec("--device", "cuda", "--model", "other/model").method is None
    assert spec("--device", "cuda", "--model", DEFAULT_MODEL, "--speculative-method", "ngram").tree is None


def test_auto_dtype_follows_the_device_the_cpu_and_the_environment(monkeypatch):
    """`--dtype auto`: bf16 on CUDA; on a CPU bf16 exactly when it multiplies bf16 natively; $STREAMSD_DTYPE
    (the test suite sets float32) decides first; a named dtype is taken as named."""
    import torch

    from streamsd.engine import builder as runtime

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("STREAMSD_DTYPE", raising=False)
    for native in (True, False):
        monkeypatch.setattr(runtime, "native_cpu_bf16", lambda native=native: native)
        assert runtime.pick_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
        assert runtime.pick_dtype("auto", cuda) == torch.bfloat16
        assert runtime.pick_dtype("float32", cuda) == torch.float32
    monkeypatch.setenv("STREAMSD_DTYPE", "float32")
    assert runtime.pick_dtype("auto", cpu) == torch.float32 and runtime.pick_dtype("bfloat16", cpu) == torch.bfloat16
