"""Self-distillation data for an EAGLE head: the target's own answers and its hidden states.

No dataset is needed: prompts come from a user file or are written by the target itself
(train/prompts.py), the target answers them with our engine (batched, in waves), and
the residual streams the head reads and the final stream whose logits are the labels are recorded
from the forward passes that generate the answers. Everything stays in memory, on the target's
device (bf16: 4 x hidden x 2 bytes per token), for the epochs that follow.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer
from streamsd.request import SamplingParams
from streamsd.train.waves import in_waves


@dataclass(slots=True)
class Sample:
    ids: list[int]  # chat-formatted prompt + the target's answer
    prompt_len: int
    streams: torch.Tensor | None = None  # [T, n * Ht] the head's input streams (bf16: SmolLM2's reach 2.5e4)
    final: torch.Tensor | None = None  # [T, Ht] the target's final pre-norm stream (labels)


@dataclass(slots=True)
class Collected:
    """What `train-draft` gathers before training: the answers with their streams, and where they came from."""

    samples: list[Sample]
    layers: tuple[int, ...]  # the streams' layers, ascending (HF hidden_states indices)
    held: list[str]  # held-out prompts: never answered here
    written: list[str]  # the prompts the target wrote itself
    train_prompts: int
    write_s: float
    generate_s: float
    temperatures: tuple[float, ...]  # the answers alternate over these
    max_new_tokens: int

    @property
    def answered(self) -> int:
        return sum(len(s.ids) - s.prompt_len for s in self.samples)

    def mismatch(self, layers: tuple[int, ...], hidden: int, vocab: int) -> str | None:
        """Why these answers cannot train a head that reads `layers` of a target of this hidden size
        and vocabulary (answers of another target, say), or None."""
        if layers != self.layers:
            return f"it holds the streams of layers {list(self.layers)}, this head reads {list(layers)}"
        first = self.samples[0] if self.samples else None
        if first is not None and first.streams is not None and first.streams.shape[-1] != len(layers) * hidden:
            return f"its streams are {first.streams.shape[-1] // len(layers)} wide, this target's {hidden}"
        if any(t >= vocab for s in self.samples for t in s.ids):
            return f"its answers hold token ids outside this target's vocabulary of {vocab}"
        return None

    def save(self, path: Path) -> None:
        """One file: the samples' streams end to end (host memory, the samples' dtype) and the rest as lists."""
        assert all(s.streams is not None and s.final is not None for s in self.samples), "samples need streams"
        torch.save({"ids": [s.ids for s in self.samples], "prompt_lens": [s.prompt_len for s in self.samples],
                    "streams": torch.cat([s.streams for s in self.samples]).cpu(),  # type: ignore[misc]
                    "final": torch.cat([s.final for s in self.samples]).cpu(),  # type: ignore[misc]
                    "layers": list(self.layers), "held": self.held, "written": self.written,
                    "train_prompts": self.train_prompts, "write_s": self.write_s, "generate_s": self.generate_s,
                    "temperatures": list(self.temperatures), "max_new_tokens": self.max_new_tokens},
                   path)

    @staticmethod
    def load(path: Path, device: torch.device) -> Collected:
        raw = torch.load(path, map_location="cpu", weights_only=True)
        lengths = [len(ids) for ids in raw["ids"]]
        streams, final = raw["streams"].to(device).split(lengths), raw["final"].to(device).split(lengths)
        samples = [Sample(ids, n, s, f) for ids, n, s, f in
                   zip(raw["ids"], raw["prompt_lens"], streams, final, strict=True)]
        return Collected(samples, tuple(raw["layers"]), raw["held"], raw["written"], raw["train_prompts"],
                         raw["write_s"], raw["generate_s"], tuple(raw["temperatures"]), raw["max_new_tokens"])


def answer(llm: Any, prompts: list[str], max_new_tokens: int, seed: int, temperatures: tuple[float, ...],
           input_layers: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, deadline: float | None = None,
           log: Callable[[str], None] | None = None) -> list[Sample]:
    """The target's answers (temperatures alternate over the prompts), batched through the engine, with
    the streams its forward passes computed on the way: no second pass over the answers.

    Streams stay on the target's device. At `deadline` (time.monotonic()) the requests still running
    are aborted and their partial answers kept: every computed token's streams are valid data.
    Every prompt position must be computed: the engine must not take prefixes from a prefix cache.
    """
    core = llm.core
    if core.scheduler.cfg.enable_prefix_caching:
        raise ValueError("answer records the streams of every position: build the LLM with enable_prefix_caching=False")
    worker = core.rt.worker
    num_layers = worker.target.args.num_layers
    layers = tuple(sorted(set(input_layers) | {num_layers}))
    cols, last = [layers.index(i) for i in input_layers], layers.index(num_layers)
    chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def record(entries: list[Any], hidden: torch.Tensor) -> None:
        # One copy per step (not per request): a graph's output is overwritten by its next replay.
        full = hidden.to(dtype, copy=True)  # [T, layers * Ht]
        for e, h in zip(entries, full.split([e.num_tokens + e.num_drafts for e in entries]), strict=True):
            chunks.setdefault(e.request.request_id, []).append((e.start, h[: e.num_tokens]))  # from e.start

    rids = [f"eagle-data-{i}" for i in range(len(prompts))]
    prompt_ids: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {r: [] for r in rids}
    finished: set[str] = set()
    t0 = last_log = time.monotonic()
    requests = []
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        prompt_ids[rid] = core.text.encode_chat([{"role": "user", "content": p}])
        requests.append((rid, prompt_ids[rid], SamplingParams(
            temperature=temperatures[i % len(temperatures)], max_tokens=max_new_tokens, seed=seed + i)))

    def cut(n: int) -> None:
        if log:
            log(f"answering: time is up, {n} answers cut short or never started")

    with worker.recording_streams(layers, record):
        for out in in_waves(core, requests, deadline, cut):
            answers[out.request_id].extend(out.token_ids)
            if out.finished:
                finished.add(out.request_id)
            if log and time.monotonic() - last_log > 15:
                last_log = time.monotonic()
                n = sum(map(len, answers.values()))
                log(f"answering: {len(finished)}/{len(rids)} done, {n} tokens, "
                    f"{n / (last_log - t0):.0f} tokens/s, {last_log - t0:.0f}s")
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
