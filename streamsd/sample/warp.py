"""Warping logits into the distribution actually sampled: temperature, top-k, top-p, min-p.

Order: temperature, then top-k, then top-p over the top-k renormalised mass, then min-p
relative to the most likely token; top-k and top-p keep or cut equal probabilities together. Every row
has its own parameters; rows share one sort (CUDA's sampling kernel cuts without one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CANDIDATES = 256  # the likeliest tokens a row's top-k/top-p cut is looked for among before sorting it whole


@dataclass(frozen=True, slots=True)
class WarpParams:
    """Per-row warping parameters on the device, built once per step."""

    temperature: torch.Tensor  # [N] float32, 0 marks a greedy row
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    needs_sort: bool  # host-side knowledge: some row uses top-k or top-p

    @staticmethod
    def build(rows: list[tuple[float, int, float, float]], device: torch.device) -> WarpParams:
        # One queued copy of all four columns: torch.tensor(..., device="cuda") would wait for the
        # GPU to finish everything queued before it.
        host = torch.tensor(rows, dtype=torch.float64).view(-1, 4)  # [N, 4] exact for these ints
        dev = host.to(device, non_blocking=device.type == "cuda")
        return WarpParams(
            temperature=dev[:, 0].float(), top_k=dev[:, 1].long(), top_p=dev[:, 2].float(), min_p=dev[:, 3].float(),
            needs_sort=any(k > 0 for _, k, _, _ in rows) or any(p < 1.0 for _, _, p, _ in rows),
        )

    def repeat(self, n: int) -> WarpParams:
        """Each row repeated n times (one per verified position)."""
        return WarpParams(
            self.temperature.repeat_interleave(n), self.top_k.repeat_interleave(n),
            self.top_p.repeat_interleave(n), self.min_p.repeat_interleave(n), self.needs_sort,
        )


def warp(logits: torch.Tensor, wp: WarpParams, reps: int = 1) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32 (greedy rows are warped at temperature 1); row i takes
    the parameters of row i // reps of `wp`."""
    if logits.is_cuda and not wp.needs_sort:  # one launch, not ~10 (kernels/sample/warp.py)
        from streamsd.kernels.sample import warp as kernel

        return kernel.warp(logits, wp.temperature, wp.min_p, reps)
    if reps > 1:
        wp = wp.repeat(reps)
    temp = torch.where(wp.temperature > 0, wp.temperature, torch.ones_like(wp.temperature))
    scaled = logits.float() / temp.unsqueeze(-1)  # [N, V]
    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    if wp.needs_sort:
        probs = _top_k_top_p(probs, wp.top_k, wp.top_p)
    max_p = probs.amax(dim=-1, keepdim=True)  # [N, 1]
    probs = torch.where(probs >= wp.min_p.unsqueeze(-1) * max_p, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The cut by threshold, ties kept together: token i survives top-k where fewer than k tokens are
    likelier, and top-p where the tokens likelier than it hold less than top-p of the top-k mass. Equal
    probabilities are all kept or all cut, so the cut is a function of the values alone, not of a sort's
    order among equals: kernels/sample/cut.py finds the same tokens without sorting.

    A row's cut is looked for among its likeliest tokens first, CANDIDATES of them, then sixteen times
    as many, and only a row whose cut falls past those is sorted whole: on a CPU, sorting 32 rows of
    49152 took half a decode step of the default model."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))  # [N]
    mass = probs.sum(dim=-1)  # [N] the top-k mass where top-k cuts nothing
    floor = torch.zeros_like(mass)  # [N]
    rows = torch.arange(probs.shape[0], device=probs.device)  # [R] the rows whose cut is still looked for
    # On CUDA every row is sorted at once: choosing rows for the next window would wait for the device.
    for candidates in (vocab,) if probs.is_cuda else (CANDIDATES, 16 * CANDIDATES, vocab):
        width = vocab if candidates >= vocab else \
            min(vocab, max(candidates, int(k[rows].masked_fill(top_k[rows] <= 0, 0).max()) + 1))
        part = probs if len(rows) == len(probs) else probs[rows]  # [R, V], a copy only once rows are left
        values = part.sort(dim=-1, descending=True).values if width == vocab else part.topk(width, dim=-1).values
        got, found = _cut_floor(values, k[rows], top_k[rows] > 0, top_p[rows], mass[rows], width == vocab)
        floor[rows] = torch.where(found, got, floor[rows])
        if width == vocab:
            break
        rows = rows[~found]
        if not len(rows):
            break
    return torch.where(probs >= floor.unsqueeze(-1), probs, torch.zeros_like(probs))


def _cut_floor(sorted_p: torch.Tensor, k: torch.Tensor, cuts_k: torch.Tensor, top_p: torch.Tensor,
               mass: torch.Tensor, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the least probability the cut keeps [N], whether the cut falls among these values [N]) from each
    row's likeliest values, best first [N, W] (`whole`: all of the row's); `cuts_k` [N]: rows with a
    top-k, whose mass is then that of the values inside it; `mass` [N] the others' top-k mass."""
    w = sorted_p.shape[-1]
    rank = torch.arange(w, device=sorted_p.device).expand_as(sorted_p)  # [N, W]
    starts = torch.ones_like(sorted_p, dtype=torch.bool)  # [N, W] the first of each run of equal values
    starts[:, 1:] = sorted_p[:, 1:] != sorted_p[:, :-1]
    first = torch.where(starts, rank, torch.zeros_like(rank)).cummax(dim=-1).values  # [N, W] its run's start
    running = sorted_p.cumsum(dim=-1)  # [N, W]
    above = (running - sorted_p).gather(-1, first)  # [N, W] the mass strictly likelier
    in_k = first < k.unsqueeze(-1)  # [N, W] fewer than k tokens strictly likelier: a prefix
    last_k = in_k.sum(dim=-1) - 1  # [N]
    mass_k = torch.where(cuts_k, running.gather(-1, last_k.unsqueeze(-1)).squeeze(-1), mass)  # [N]
    p = top_p.unsqueeze(-1)  # [N, 1]
    keep = in_k & ((p >= 1.0) | (above < p * mass_k.unsqueeze(-1)) | (first == 0))  # [N, W] a prefix
    last = keep.sum(dim=-1) - 1  # [N]
    floor = sorted_p.gather(-1, last.unsqueeze(-1)).squeeze(-1)  # [N]
    if whole:
        return floor, torch.ones_like(last, dtype=torch.bool)
    return floor, (last < w - 1) & (~cuts_k | (last_k < w - 1))
