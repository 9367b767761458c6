"""vLLM's `--speculative-config` JSON, read into streamsd's own speculation options.

A vLLM user's command line carries speculation as one JSON object, e.g.
`{"method": "eagle3", "model": "heads/llama-8b", "num_speculative_tokens": 4}`. The keys streamsd can
honour map onto its flags; any other key, or a method it does not have, is refused by name rather than
ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's method names -> streamsd's (--speculative-method)
METHODS = {"ngram": "ngram", "eagle": "eagle", "eagle3": "eagle", "draft_model": "draft"}
KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "disable_by_batch_size", "draft_tensor_parallel_size"}


@dataclass(frozen=True, slots=True)
class SpeculativeOptions:
    method: str  # streamsd's: ngram, eagle or draft
    draft_model: str | None
    num_tokens: int | None  # None: streamsd's default K
    ngram_max: int | None
    ngram_min: int | None
    max_batch: int | None  # speculate only while at most this many requests decode


def parse(text: str) -> SpeculativeOptions:
    """The options of a `--speculative-config` value; ValueError naming what cannot be honoured."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = sorted(set(cfg) - KEYS)
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported here (supported: "
                         f"{', '.join(sorted(KEYS))})")
    model = cfg.get("model")
    method = cfg.get("method", "draft_model" if model else None)
    if method not in METHODS:
        raise ValueError(f"--speculative-config: method {method!r} not supported here (supported: "
                         f"{', '.join(METHODS)})")
    if METHODS[method] != "ngram" and not model:
        raise ValueError(f"--speculative-config: method {method!r} needs a model (the draft model or the EAGLE head)")
    if cfg.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1 (the drafter runs on rank 0)")
    return SpeculativeOptions(
        method=METHODS[method], draft_model=model,
        num_tokens=_positive(cfg, "num_speculative_tokens"), ngram_max=_positive(cfg, "prompt_lookup_max"),
        ngram_min=_positive(cfg, "prompt_lookup_min"), max_batch=_positive(cfg, "disable_by_batch_size"),
    )


def _positive(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--speculative-config: {key} must be a positive integer, got {value!r}")
    return value
