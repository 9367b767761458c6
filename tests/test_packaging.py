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
