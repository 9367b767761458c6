"""Self-distillation data for an EAGLE head: prompts, the target's own answers, its hidden states.

No dataset is needed: prompts come from a user file or are written by the target itself (sampled
after its chat template's user prefix), the target answers them with our engine (batched), and
the residual streams the head reads and the final stream whose logits are the labels are recorded
from the forward passes that generate the answers. Everything stays in memory, on the target's
device (bf16: 4 x hidden x 2 bytes per token), for the epochs that follow.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsd.model.graphs import GraphRunner
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer
from streamsd.request import SamplingParams

_SENTINEL = "\u2063PROMPT\u2063"


@dataclass(slots=True)
class Sample:
    ids: list[int]  # chat-formatted prompt + the target's answer
    prompt_len: int
    streams: torch.Tensor | None = None  # [T, n * Ht] the head's input streams (bf16: SmolLM's reach 2e4)
    final: torch.Tensor | None = None  # [T, Ht] the target's final pre-norm stream (labels)


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


def user_prefix(tokenizer: Any) -> str:
    """The chat template's text up to where a user turn's content starts (system prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
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
# in one narrow style; a head trained on those alone drafts poorly for anything else (the H200 head:
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


def in_waves(core: Any, requests: list[tuple[str, list[int], SamplingParams]], deadline: float | None = None,
             on_deadline: Callable[[int], None] | None = None) -> Iterator[Any]:
    """Every output of `requests` (id, prompt ids, params) through the engine, admitted a quarter of
    the batch at a time.

    Only decode steps replay CUDA graphs; a step that carries a new request's prompt chunk runs
    eagerly. Admitting each request the moment another finishes (what a server must do) puts a
    prompt chunk into a large share of the steps of a long offline run with answers of mixed lengths
    (25 % of the steps at batch 64 on the CPU); in waves, all but a few steps per wave are graph
    replays. At `deadline` (time.monotonic()) the running requests are aborted, the rest dropped.
    """
    cap = core.scheduler.cfg.max_num_seqs
    wave = max(1, cap // 4)
    pending = collections.deque(requests)
    live: set[str] = set()
    while pending or core.has_work:
        if deadline is not None and time.monotonic() > deadline:
            for rid in live:
                core.abort(rid)  # finalised by the next step's schedule
            if on_deadline:
                on_deadline(len(live) + len(pending))
            pending.clear()
            deadline = None
        if pending and len(live) <= cap - wave:
            while pending and len(live) < cap:
                rid, ids, params = pending.popleft()
                core.add_request(rid, ids, params)
                live.add(rid)
        for out in core.step():
            if out.finished:
                live.discard(out.request_id)
            yield out


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


class _Recorder:
    """Stands in for a proposer so the worker returns the streams of every computed token; drafts nothing."""

    dense = False
    keeps_cache = False

    def __init__(self, layers: tuple[int, ...]):
        self.hidden_layers = layers

    def propose(self, items: list[Any]) -> list[Any]:
        return []


def answer(llm: Any, prompts: list[str], max_new_tokens: int, seed: int, temperatures: tuple[float, ...],
           input_layers: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, deadline: float | None = None,
           log: Callable[[str], None] | None = None) -> list[Sample]:
    """The target's answers (temperatures alternate over the prompts), batched through the engine, with
    the streams its forward passes computed on the way: no second pass over the answers.

    Streams stay on the target's device. At `deadline` (time.monotonic()) the requests still running
    are aborted and their partial answers kept: every computed token's streams are valid data.
    """
    core = llm.core
    worker = core.rt.worker
    num_layers = worker.target.args.num_layers
    layers = tuple(sorted(set(input_layers) | {num_layers}))
    cols, last = [layers.index(i) for i in input_layers], layers.index(num_layers)
    chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    forward, proposer, graphs = worker._forward, worker.proposer, worker.graphs

    def recording(entries: list[Any]) -> tuple[torch.Tensor, Any]:
        logits, hidden = forward(entries)
        # One copy per step (not per request): a graph's output is overwritten by its next replay.
        full = torch.cat(hidden).to(dtype)  # [T, layers * Ht]
        for e, h in zip(entries, full.split([h.shape[0] for h in hidden]), strict=True):
            chunks.setdefault(e.request.request_id, []).append((e.start, h[: e.num_tokens]))  # from e.start
        return logits, hidden

    worker._forward, worker.proposer = recording, _Recorder(layers)
    if graphs is not None:  # decode-only steps replay graphs that also return these streams
        worker.graphs = GraphRunner(graphs.model, graphs.cache, graphs.scratch, graphs.cfg, graphs.device,
                                    hidden_layers=layers)
    rids = [f"eagle-data-{i}" for i in range(len(prompts))]
    prompt_ids: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {r: [] for r in rids}
    finished: set[str] = set()
    t0 = last_log = time.monotonic()
    requests = []
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        prompt_ids[rid] = core.encode_chat([{"role": "user", "content": p}])
        requests.append((rid, prompt_ids[rid], SamplingParams(
            temperature=temperatures[i % len(temperatures)], max_tokens=max_new_tokens, seed=seed + i)))

    def cut(n: int) -> None:
        if log:
            log(f"answering: time is up, {n} answers cut short or never started")

    try:
        for out in in_waves(core, requests, deadline, cut):
            answers[out.request_id].extend(out.token_ids)
            if out.finished:
                finished.add(out.request_id)
            if log and time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                n = sum(map(len, answers.values()))
                log(f"answering: {len(finished)}/{len(rids)} done, {n} tokens, "
                    f"{n / (last_log - t0):.0f} tokens/s, {last_log - t0:.0f}s")
    finally:
        worker._forward, worker.proposer, worker.graphs = forward, proposer, graphs
    out = []
    for rid in rids:
        parts = chunks.pop(rid, [])
        ids = prompt_ids[rid] + answers[rid]
        if not answers[rid] or not parts:
            continue
        n = min(max(s + h.shape[0] for s, h in parts), len(ids))  # the last token is sampled, never computed
        if n <= len(prompt_ids[rid]):
            continue  # cut short before any answer token's streams were computed: nothing to learn from
        ends = list(itertools.accumulate(h.shape[0] for _, h in parts))
        if all(s == e for (s, _), e in zip(parts, [0, *ends[:-1]], strict=True)):
            rows = torch.cat([h for _, h in parts])[:n]  # in order, no recompute: one copy
        else:  # in step order: a recompute after preemption overwrites
            rows = torch.zeros(n, parts[0][1].shape[-1], dtype=dtype, device=parts[0][1].device)
            for s, h in parts:
                rows[s : min(s + h.shape[0], n)] = h[: max(0, n - s)]
        per = rows.view(n, len(layers), -1)  # [n, layers, Ht]
        out.append(Sample(ids[:n], len(prompt_ids[rid]), per[:, cols].reshape(n, -1), per[:, last].clone()))
    return out


@torch.inference_mode()
def attach_streams(target: Transformer, samples: list[Sample], input_layers: tuple[int, ...],
                   batch_tokens: int = 4096, progress: Any = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """One prefill pass per sample: the head's input streams and the final stream (labels)."""
    layers = tuple(sorted(set(input_layers) | {target.args.num_layers}))
    cols = [layers.index(i) for i in input_layers]
    dev = target.rope_cos.device
    bs = 16
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    i = 0
    while i < len(order):
        group = [order[i]]
        while i + len(group) < len(order) and sum(len(samples[g].ids) for g in group) + len(
                samples[order[i + len(group)]].ids) <= batch_tokens:
            group.append(order[i + len(group)])
        i += len(group)
        seqs = [samples[g].ids for g in group]
        blocks = [-(-len(s) // bs) for s in seqs]
        cache = PagedKVCache(target.args, sum(blocks), bs, target.model.embed_tokens.weight.dtype, dev)
        tables, nxt = [], 0
        for b in blocks:
            tables.append(list(range(nxt, nxt + b)))
            nxt += b
        layout = BatchLayout.build([0] * len(seqs), [len(s) for s in seqs], tables, bs, dev)
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=dev)
        rows = torch.arange(flat.numel(), device=dev)
        out = target(flat, layout, cache, rows[:1], hidden_layers=layers, hidden_rows=rows)
        hidden = torch.stack(out.hidden, dim=1)  # [T, n, Ht]
        for g, part in zip(group, hidden.split([len(s) for s in seqs]), strict=True):
            samples[g].streams = part[:, cols].reshape(part.shape[0], -1).to(dtype).clone()
            samples[g].final = part[:, layers.index(target.args.num_layers)].to(dtype).clone()
        if progress is not None:
            progress.update(len(group))


def draft_vocabulary(samples: list[Sample], size: int, vocab: int, always: set[int]) -> list[int]:
    """The `size` target ids most frequent in the answers (then prompts, then lowest ids) — sorted."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.ids[s.prompt_len:], dtype=torch.int64), minlength=vocab).double()
        counts += 1e-3 * torch.bincount(torch.tensor(s.ids[: s.prompt_len], dtype=torch.int64), minlength=vocab).double()
    counts -= 1e-9 * torch.arange(vocab, dtype=torch.float64)  # ties: lower ids, the more common merges
    for t in always:
        counts[t] = float("inf")
    return sorted(counts.topk(min(size, vocab)).indices.tolist())
