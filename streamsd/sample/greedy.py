"""Greedy verification of a packed verify step, in torch ops a CUDA graph captures.

A graph that runs a verify forward also emits this step's greedy result (model/graphs.py): for
steps where every request is greedy, the worker reads it instead of queueing the sampler (the
argmax, the per-request integers, the rejection kernel: ~0.2 ms of host time a step, which bounds
an EAGLE step on a small target). It is the rejection sampler's greedy rule exactly: accept draft
j while it equals the target's argmax at the row before it, then emit that argmax.
"""

from __future__ import annotations

import torch


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...] int64, torch.argmax(x, -1) (the first maximum); inside a CUDA graph, for a
    few rows, in parallel chunks (kernels/sample/warp_chunked.py: torch's reduction took 13 us a row of
    SmolLM2's 49152 ids, and an EAGLE step at T = 0 has ~6 of them in its graphs)."""
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return x.argmax(dim=-1)  # eagerly torch's one launch: a Triton launch costs far more host time
    from streamsd.kernels.sample import warp_chunked as kernel

    rows = x.reshape(-1, x.shape[-1])
    return kernel.row_argmax(rows).view(x.shape[:-1]) if rows.shape[0] <= kernel.MAX_ROWS else x.argmax(dim=-1)


def greedy_verify(logits: torch.Tensor, ids: torch.Tensor, query_starts: torch.Tensor, num_seqs: int,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V] and ids [T] of a step packed from the front (sequence s: its pending token then
    its drafts, at rows query_starts[s] ..< query_starts[s + 1]) -> tokens [S, W] (the accepted
    drafts, then the target's token, then -1) and accepted [S]. Sequences with no tokens (padding)
    give garbage nobody reads."""
    t_all = logits.shape[0]
    argmax = row_argmax(logits)  # [T]
    qs = query_starts[:num_seqs].unsqueeze(1)  # [S, 1]
    drafts = (query_starts[1 : num_seqs + 1] - query_starts[:num_seqs] - 1).unsqueeze(1)  # [S, 1]
    j = torch.arange(width, device=logits.device)  # [W]
    row = (qs + torch.minimum(j, drafts.clamp(min=0))).clamp(max=t_all - 1)  # [S, W] row of position j
    target = argmax[row]  # [S, W] the target's token after position j
    proposed = ids[(qs + j + 1).clamp(max=t_all - 1)]  # [S, W] draft j + 1 (past the drafts: unread)
    ok = (proposed == target) & (j < drafts)  # [S, W]
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [S]
    n = accepted.unsqueeze(1)  # [S, 1]
    tokens = torch.where(j < n, proposed, torch.where(j == n, target.gather(1, n), -1))  # [S, W]
    return tokens, accepted
