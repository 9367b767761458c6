"""Prompt sources for `streamsd bench serve`: MT-bench JSONL, ShareGPT JSON, random text.

Every loader returns plain `BenchPrompt`s holding the user text; the client turns that into
a chat message or a completions prompt, so one dataset serves both endpoints.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Random prompts are built from common short words so that, for most BPE tokenizers, one word is
# close to one token; we do not load the server's tokenizer, which may live on another machine.
_WORDS = (
    "the of and to in is was for on that with as by at from his her are were this which be or "
    "have had not but one all they their an has been more when will would there who can said "
    "time new year state first two after people into some could them other about than then "
    "only over also its back day used many may make made such way even well most life world"
).split()


# Short everyday chat requests with a follow-up each, in MT-Bench's format, written apart from MT-Bench
# (which the shipped EAGLE head's evaluation uses): prompts nothing in the project was tuned on.
CHAT_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "bench" / "chat-prompts.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    """One request's prompt; `output_len` (tokens) only when the dataset prescribes one."""

    text: str
    output_len: int | None = None
    follow_up: str | None = None  # the conversation's next user turn (MT-bench's second), for --multi-turn


def load_mt_bench(path: str | Path) -> list[BenchPrompt]:
    """MT-bench question file: one JSON object per line with `turns`; the first turn is the prompt,
    the second its follow-up."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        turns = json.loads(line).get("turns") or []
        if turns and isinstance(turns[0], str) and turns[0].strip():
            second = turns[1] if len(turns) > 1 and isinstance(turns[1], str) and turns[1].strip() else None
            prompts.append(BenchPrompt(turns[0], follow_up=second))
    return prompts


def load_sharegpt(path: str | Path) -> list[BenchPrompt]:
    """ShareGPT JSON: a list of `{"conversations": [{"from": "human"|"gpt", "value": str}, ...]}`.

    The first human turn is the prompt. The reference reply's word count becomes `output_len`
    so that, like vLLM's loader, output lengths follow the dataset unless --max-tokens is given.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    prompts = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None or not str(turns[human].get("value", "")).strip():
            continue
        reply = turns[human + 1].get("value", "") if human + 1 < len(turns) else ""
        out_len = len(str(reply).split()) or None
        prompts.append(BenchPrompt(str(turns[human]["value"]), out_len))
    return prompts


def random_prompts(n: int, input_len: int, output_len: int | None, seed: int) -> list[BenchPrompt]:
    """`n` prompts of `input_len` random words each; distinct prefixes defeat prefix caching."""
    rng = random.Random(seed)
    return [
        BenchPrompt(f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(max(1, input_len))), output_len)
        for i in range(n)
    ]


def shared_prefix(words: int, seed: int) -> str:
    """The system prompt every request of a shared-prefix run starts with: about `words` tokens of
    random words, the same for a seed, and drawn apart from the prompts' own words (another stream)."""
    rng = random.Random(f"shared-prefix:{seed}")
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def load_dataset(
    spec: str,
    num_prompts: int,
    *,
    seed: int = 0,
    random_input_len: int = 128,
    random_output_len: int | None = None,
) -> list[BenchPrompt]:
    """Resolve `--dataset`: `random`, `random:<len>`, a `.jsonl` MT-bench file or a ShareGPT `.json`.

    File datasets are taken in file order and cycled when they hold fewer than `num_prompts`
    entries, so every run and every cell of a sweep sends the same prompts.
    """
    if spec == "random" or spec.startswith("random:"):
        length = int(spec.split(":", 1)[1]) if ":" in spec else random_input_len
        return random_prompts(num_prompts, length, random_output_len, seed)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {spec}")
    prompts = load_mt_bench(path) if _is_jsonl(path) else load_sharegpt(path)
    if not prompts:
        raise ValueError(f"no usable prompts in {spec}")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def _is_jsonl(path: Path) -> bool:
    if path.suffix == ".jsonl":
        return True
    head = path.read_text(encoding="utf-8").lstrip()[:1]
    return head == "{"
