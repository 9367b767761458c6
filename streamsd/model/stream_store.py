"""The target's residual streams kept per KV slot, for an EAGLE head that catches up later.

An EAGLE head reads the target's streams at the layers it fuses (spec_decode/eagle/proposer.py). A step's streams
exist only while that step runs, so without a place to keep them the head had to follow every step,
plain ones included: an EAGLE engine could not take the genuine plain step (the target alone,
queued ahead, worker/lookahead.py) when the adaptive policy chose k = 0 for the whole batch. Every target
forward of such an engine therefore also writes each token's streams here, at the same flat slot as
its K/V (in a CUDA graph, inside the graph). The head catches up from here when a request speculates
again, the way a draft model replays its missed KV as a prefill chunk, and the planner prices that
replay (CostTable.catchup). A slot's streams are valid exactly when its K/V is: the same forwards
write both, at the same slots, so a rejected draft's slot is rewritten before anything reads it.
"""

from __future__ import annotations

import torch


class StreamStore:
    """[num_slots, len(layers) * hidden] streams, one row per flat KV slot."""

    def __init__(self, layers: tuple[int, ...], hidden: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device):
        self.layers = layers  # the target layers whose input streams are kept, ascending
        self.data = torch.zeros(num_slots, len(layers) * hidden, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(layers: tuple[int, ...], hidden: int, dtype: torch.dtype) -> int:
        return len(layers) * hidden * torch.empty(0, dtype=dtype).element_size()

    def write(self, streams: torch.Tensor, slots: torch.Tensor) -> None:
        """streams [T, layers * hidden] at the flat KV slots [T]."""
        self.data.index_copy_(0, slots, streams.to(self.data.dtype))

    def gather(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The streams at the flat KV slots [T] (a layout's slot mapping): [T, layers * hidden]."""
        return torch.index_select(self.data, 0, slots, out=out) if out is not None else self.data.index_select(0, slots)


def keep_streams(hidden: list[torch.Tensor] | None, slots: torch.Tensor, store: StreamStore | None
                 ) -> torch.Tensor | None:
    """A forward's captured streams side by side, [T, layers * hidden] (None when it captured none),
    also written into `store` at the tokens' KV slots [T] when there is one."""
    if not hidden:
        return None
    streams = torch.cat(hidden, dim=-1)
    if store is not None:
        store.write(streams, slots)
    return streams
