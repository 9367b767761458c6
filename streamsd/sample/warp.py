"""Warping logits into the distribution actually sampled: temperature, top-k, top-p, min-p.

Order: temperature, then top-k, then top-p over the top-k renormalised mass, then min-p
relative to the most likely token. Every row has its own parameters; rows share one sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)  # [N, 1]
    sorted_p = torch.where(rank < k, sorted_p, torch.zeros_like(sorted_p))
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [N, V]
    keep = (mass_before < top_p.unsqueeze(-1)) | (rank == 0)
    sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
