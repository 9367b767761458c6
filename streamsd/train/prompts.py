"""Prompts for self-distillation: read from a user file, or written by the target itself.

With no dataset, the target writes user turns: sampled after its chat template's user prefix and
one of a set of task openers, duplicates and degenerate ones dropped.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamsd.model.tokenizer import Tokenizer
from streamsd.request import SamplingParams
from streamsd.train.waves import in_waves

_SENTINEL = "\u2063PROMPT\u2063"


def read_prompts(path: Path) -> list[str]:
    """First user turns of a JSONL file (`turns`, `prompt`, `question`, `text` or `instruction`),
    or one prompt per non-empty line of a text file."""
    out: list[str] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            row = json.loads(line)
            turns = row.get("turns")
            text = turns[0] if turns else next((row[k] for k in ("prompt", "question", "text", "instruction")
                                                if row.get(k)), None)
            if isinstance(text, str) and text.strip():
                out.append(text.strip())
        else:
            out.append(line)
    return out


def user_prefix(tokenizer: Tokenizer) -> str:
    """The chat template's text up to where a user turn's content starts (system prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}])
    return text[: text.index(_SENTINEL)]


def is_degenerate(text: str) -> bool:
    words = text.split()
    if not 3 <= len(words) <= 120 or "<|" in text or "\ufffd" in text:
        return True
    if len(set(words)) < 0.5 * len(words):  # loops like "the the the"
        return True
    return not re.search(r"[A-Za-z]{3}", text)


# First words of user turns across the kinds of request a chat model gets (writing, role-play,
# reasoning, maths, coding, extraction, STEM, humanities). Left alone, a small model writes user turns
# in one narrow style; a head trained on those alone drafts poorly for anything else (an H200 head:
# top-1 0.42 on fresh self-written prompts, 0.29 on MT-Bench). Empty: no opener.
OPENERS = (
    "", "", "Write a Python function that", "Write a short story about", "Solve the following problem step by step:",
    "Extract the names and dates from this text:", "Imagine you are", "Explain the difference between",
    "Write a SQL query that", "Summarize the following paragraph:", "What is the derivative of",
    "Compose a polite email to", "Create a table comparing", "Here is some JavaScript code. Find the bug:",
    "Give me three arguments for and against", "Translate into French:", "List the steps to",
    "Describe the causes of", "If a train travels", "Rewrite this sentence to be more formal:",
    "Write a haiku about", "What would happen if", "Return a JSON object with", "Prove that",
    "As a travel guide, recommend", "Write a C++ program to", "Classify the following reviews as positive or negative:",
    "Explain to a ten-year-old how", "Draft a cover letter for", "Calculate the area of",
    "Discuss the themes of", "Suggest a name and slogan for", "Given the list of numbers",
)


def self_prompts(llm: Any, n: int, seed: int, avoid: set[str], max_tokens: int = 64, deadline: float | None = None,
                 log: Callable[[str], None] | None = None, openers: tuple[str, ...] = OPENERS) -> list[str]:
    """Up to n distinct user turns written by the target (sampled after the user prefix and one of
    `openers`, in turn); in rounds of at most 2048 samples, so a `deadline` (time.monotonic()) is
    checked between rounds."""
    head = user_prefix(llm.tokenizer)
    starts = [list(llm.tokenizer.encode(head + o, add_special_tokens=False)) for o in (openers or ("",))]
    seen = {_norm(p) for p in avoid}
    out: list[str] = []
    drawn = 0
    for _ in range(8 + n // 512):
        if deadline is not None and time.monotonic() > deadline:
            if log:
                log(f"writing prompts: time is up at {len(out)} of {n}")
            break
        want = min(2048, 2 * (n - len(out)) + 8)  # some are filtered away
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed + drawn + i)
                  for i in range(want)]
        drawn += want
        picks = [(drawn - want + i) % len(starts) for i in range(want)]
        rids = [f"eagle-prompt-{drawn - want + i}" for i in range(want)]
        texts = dict.fromkeys(rids, "")
        reasons: dict[str, str | None] = {}
        for res in in_waves(llm.core, [(r, starts[j], p) for r, j, p in zip(rids, picks, params, strict=True)]):
            texts[res.request_id] += res.text
            if res.finished:
                reasons[res.request_id] = res.finish_reason
        for pick, rid in zip(picks, rids, strict=True):
            text = written_prompt(openers[pick] if openers else "", texts[rid], reasons.get(rid))
            if text is None or _norm(text) in seen:
                continue
            seen.add(_norm(text))
            out.append(text)
            if len(out) >= n:
                return out
        if log:
            log(f"writing prompts: {len(out)} of {n} kept from {drawn} drawn")
    return out


def written_prompt(opener: str, continuation: str, finish_reason: str | None) -> str | None:
    """The user turn the target wrote after `opener`, or None when it is unfinished, degenerate, or
    nothing but the opener."""
    text = (opener + continuation).strip()
    if finish_reason != "stop" or is_degenerate(text) or (opener and len(continuation.split()) < 2):
        return None
    return text


def _norm(text: str) -> str:
    return " ".join(text.lower().split())
