"""The wheel ships every package and the chat UI."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    from streamsd.cli import DEFAULT_MODEL, default_speculation

    assert default_speculation(DEFAULT_MODEL, None, "cuda") == "eagle"
    assert default_speculation(DEFAULT_MODEL, None, "cpu") == "ngram"
    assert default_speculation(DEFAULT_MODEL, "some/draft", "cuda") == "draft"
    assert default_speculation("some/other-model", None, "cuda") == "none"


def test_auto_dtype_follows_the_device_the_cpu_and_the_environment(monkeypatch):
    """`--dtype auto`: bf16 on CUDA; on a CPU bf16 exactly when it multiplies bf16 natively; $STREAMSD_DTYPE
    (the test suite sets float32) decides first; a named dtype is taken as named."""
    import torch

    from streamsd import runtime

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("STREAMSD_DTYPE", raising=False)
    for native in (True, False):
        monkeypatch.setattr(runtime, "native_cpu_bf16", lambda native=native: native)
        assert runtime.pick_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
        assert runtime.pick_dtype("auto", cuda) == torch.bfloat16
        assert runtime.pick_dtype("float32", cuda) == torch.float32
    monkeypatch.setenv("STREAMSD_DTYPE", "float32")
    assert runtime.pick_dtype("auto", cpu) == torch.float32 and runtime.pick_dtype("bfloat16", cpu) == torch.bfloat16
