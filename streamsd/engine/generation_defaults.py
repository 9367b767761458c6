"""A model's own sampling defaults, from its generation_config.json, for requests that leave them out.

Models ship the sampling they were tuned for (SmolLM2-135M-Instruct's card: temperature 0.2, top-p
0.9; Qwen2: temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05); a small model sampled at
the OpenAI default of temperature 1.0 rambles. As vLLM's ``--generation-config auto`` does, a field a
request does not set takes the model's value, and only then the API's own default; ``none`` ignores
the file. An explicit value always wins, and ``do_sample`` is not read (vLLM does not either).

Imports no torch: the server's wire layer uses it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from streamsd.request import SamplingParams

MODES = ("auto", "none")
log = logging.getLogger("streamsd")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The model's defaults; None where the model sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> GenerationDefaults:
        """The sampling fields of a generation_config.json's content; others are ignored."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = config.get(f.name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            value = max(int(v), 0) if f.name == "top_k" else float(v)  # top_k -1: no cut, as 0
            if not _valid(f.name, value):
                log.warning("ignoring the model's default %s=%r: out of range", f.name, v)
                continue
            values[f.name] = value
        return cls(**values)

    @classmethod
    def read(cls, model_dir: Path, mode: str = "auto") -> GenerationDefaults:
        """``model_dir``'s defaults (``mode`` auto), or none at all (``mode`` none, or no readable file)."""
        if mode not in MODES:
            raise ValueError(f"--generation-config must be auto or none, not {mode!r}")
        path = Path(model_dir) / "generation_config.json"
        if mode == "none" or not path.is_file():
            return cls()
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s, which does not parse (%s): no model sampling defaults", path, exc)
            return cls()
        return cls.from_dict(content) if isinstance(content, dict) else cls()

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def log_at_load(self, source: Path) -> None:
        applied = self.as_dict()
        if applied:
            log.info("sampling defaults from %s for requests that leave them out: %s", source,
                     ", ".join(f"{k}={v:g}" for k, v in applied.items()))

    def sampling_params(self, *, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, min_p: float | None = None,
                        repetition_penalty: float | None = None, fallback_temperature: float = 1.0,
                        **rest: Any) -> SamplingParams:
        """SamplingParams with every sampling field the caller left None taken from the model, else from
        the API's defaults (temperature ``fallback_temperature``, no top-p/top-k/min-p cut, no
        repetition penalty)."""
        def pick(given: Any, model: Any, fallback: Any) -> Any:
            return given if given is not None else model if model is not None else fallback

        return SamplingParams(temperature=pick(temperature, self.temperature, fallback_temperature),
                              top_p=pick(top_p, self.top_p, 1.0), top_k=pick(top_k, self.top_k, 0),
                              min_p=pick(min_p, self.min_p, 0.0),
                              repetition_penalty=pick(repetition_penalty, self.repetition_penalty, 1.0), **rest)


def _valid(name: str, value: float) -> bool:
    """Whether a request could ask for this value (a model's default out of range must not turn every
    request that leaves the field out into a 400 naming a field the client never sent)."""
    field_value: dict[str, Any] = {name: value}  # one named field, so SamplingParams's own types don't apply
    try:
        SamplingParams(**field_value)
    except ValueError:
        return False
    return True
