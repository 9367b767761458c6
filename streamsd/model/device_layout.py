"""A step's layout written on the device: for a step queued before the host knows where its
sequences start (streamsd/worker/lookahead.py), positions, KV slots, context lengths and ids come from the
step before's results, still on the device. One Triton launch on CUDA (kernels/model/device_layout.py), torch
ops elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceStarts:
    """Where the sequences of a step queued ahead start, on the device (worker/lookahead.py): either given
    (`starts` [S]) or computed from the verify before (start + 1 + accepted, into `starts`), with
    then also the ids: each sequence's bonus token and its drafts."""

    starts: torch.Tensor  # [S] int64, in or out
    prev: torch.Tensor | None = None  # [S] the previous verify's starts
    accepted: torch.Tensor | None = None  # [S]
    tokens: torch.Tensor | None = None  # [S, K+1] the previous verify's emitted tokens
    drafts: torch.Tensor | None = None  # [S, width - 1] the drafts to verify now

    def resolve(self) -> torch.Tensor | None:
        """The torch path: fills `starts` when computed, returns the ids [S * width] (or None)."""
        if self.prev is None or self.accepted is None:
            return None
        self.starts.copy_(self.prev + 1 + self.accepted)
        if self.tokens is None or self.drafts is None:
            return None
        return torch.cat([self.tokens.gather(1, self.accepted.unsqueeze(1)), self.drafts], dim=1).view(-1)


def restart(packed: torch.Tensor, t_all: int, src: DeviceStarts, width: int, block_table: torch.Tensor,
            block_size: int, base: torch.Tensor | None = None) -> None:
    """Positions, KV slots and context lengths (and ids, when `src` has them) of a packed step's first
    S sequences rewritten on the device, each `width` tokens from its start; `base` [S] gets start + 1.
    The block table must already be in place."""
    if packed.is_cuda:  # one launch, not ~25 (kernels/model/device_layout.py)
        from streamsd.kernels.model import device_layout as kernel

        kernel.restart(packed, t_all, src, width, block_table, block_size, base)
        return
    ids = src.resolve()
    starts, n = src.starts, src.starts.shape[0]
    if ids is not None:
        packed[: ids.shape[0]] = ids
    pos = starts.unsqueeze(1) + torch.arange(width, device=starts.device)  # [S, width]
    block = block_table[:n].gather(1, pos // block_size).long()  # [S, width]
    packed[t_all : t_all + n * width] = pos.view(-1)
    packed[2 * t_all : 2 * t_all + n * width] = (block * block_size + pos % block_size).view(-1)
    packed[3 * t_all : 3 * t_all + n] = starts + width
    if base is not None:
        base[:n] = starts + 1
