"""streamsd — a streaming LLM server built around lossless speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamsd.request import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from streamsd.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import streamsd` light for the CLI and the server's wire layer.
    if name == "LLM":
        from streamsd.engine.llm import LLM

        return LLM
    raise AttributeError(name)
