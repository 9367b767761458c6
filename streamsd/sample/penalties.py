"""Logit bias and repetition, frequency and presence penalties, applied to the target's logits.

In vLLM's order (HF's too, for the two it has): `logit_bias` is added; then the repetition penalty
divides the positive logits, and multiplies the others, of every token in the prompt or the output;
then `logits -= frequency * count + presence * (count > 0)` over the output's token counts. Warping
(temperature, top-k, top-p, min-p) comes after, so p — what greedy rows take the argmax of, what
sampled rows race over and what the rejection sampler tests drafts against — is the penalised
distribution, and the log-probabilities reported are those of the penalised logits.

**Exact under speculation.** A penalty makes p depend on the tokens generated before its position.
Row j of a verify window decides the token after drafts 0..j-1, and that token is emitted only if
those drafts are accepted, i.e. generated: so row j counts them as output, position by position (a
tree's row counts the drafts on its own path, root to node). Each row's p is then exactly the p a
plain step would use there, and rejection sampling keeps the output distribution whatever the draft
did; the drafts' q need not be penalised. At temperature 0 a row takes the argmax of its penalised
logits, so speculative greedy output is plain greedy output token for token.

Rows of requests without any of these are left as they are, with no host work beyond one flag read;
steps the host prepares before it knows their tokens (worker/lookahead.py, the tree and greedy
verify graphs) never carry a penalised request.
"""

from __future__ import annotations

import numpy as np
import torch

from streamsd.model.kv_cache import h2d
from streamsd.sched.plan import Scheduled


def chain_bits(width: int) -> list[int]:
    """The window rows each row of a chain sees (bit i: row i; row 0 holds the pending token, row
    i >= 1 draft i - 1): rows 0..j."""
    return [(1 << (j + 1)) - 1 for j in range(width)]


def penalise(entries: list[Scheduled], rows: torch.Tensor, bits: list[list[int]] | None = None,
             pick: list[int] | None = None) -> torch.Tensor:
    """rows [B, W, V]: entry b's logits at its window rows -> the same, each penalised request's rows
    penalised (in float32; a new tensor). `bits[b][j]`: the window rows row j sees (tree_verify.host_tree's),
    default a chain's; the drafts at those rows count as generated output for row j. `pick`: the
    entries whose requests are penalised, when the caller has them."""
    if pick is None:
        pick = [b for b, e in enumerate(entries) if e.request.params.penalties]
    if not pick:
        return rows
    n, width, vocab = len(pick), rows.shape[1], rows.shape[2]
    chain = chain_bits(width)
    output: list[np.ndarray] = []  # flat indices into counts [P, V]
    window: list[np.ndarray] = []  # flat indices into counts [P, W, V]
    prompt: list[np.ndarray] = []  # flat indices into the prompt mask [P, V]
    bias_at: list[np.ndarray] = []
    bias_by: list[np.ndarray] = []
    scalars: list[tuple[float, float, float]] = []
    for i, b in enumerate(pick):
        e = entries[b]
        r, p = e.request, e.request.params
        output.append(np.asarray(r.output_ids, dtype=np.int64) + i * vocab)
        if p.repetition_penalty != 1.0:
            prompt.append(np.asarray(r.prompt_ids, dtype=np.int64) + i * vocab)
        drafts = r.draft_ids[: e.num_drafts]
        seen = chain if bits is None else bits[b]
        for j in range(min(width, e.num_drafts + 1)):  # rows past the drafts are padding, never read
            window.append(np.asarray([(i * width + j) * vocab + t for d, t in enumerate(drafts)
                                      if seen[j] >> (d + 1) & 1], dtype=np.int64))
        if p.logit_bias:
            bias_at.append(np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)) + i * vocab)
            bias_by.append(np.fromiter(p.logit_bias.values(), dtype=np.float64, count=len(p.logit_bias)))
        scalars.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    dev = rows.device
    parts = [np.asarray(pick, dtype=np.int64), *(_cat(x) for x in (output, window, prompt, bias_at))]
    sizes = np.cumsum([0, *(len(x) for x in parts)])
    ints = h2d(torch.from_numpy(np.concatenate(parts)), torch.int64, dev)  # one copy of every index
    index, out_at, win_at, prompt_at, bias_idx = (ints[sizes[k] : sizes[k + 1]] for k in range(5))
    floats = h2d(torch.from_numpy(np.concatenate([np.asarray(scalars, dtype=np.float64).T.ravel(), _cat(bias_by, np.float64)])),
                 torch.float32, dev)
    rep, freq, pres = (floats[k * n : (k + 1) * n].view(n, 1, 1) for k in range(3))
    bias = torch.zeros(n * vocab, dtype=torch.float32, device=dev).index_put_((bias_idx,), floats[3 * n :],
                                                                               accumulate=True)
    counts = _count(out_at, n * vocab).view(n, 1, vocab) + _count(win_at, n * width * vocab).view(n, width, vocab)
    in_prompt = _count(prompt_at, n * vocab).view(n, 1, vocab) > 0  # [P, 1, V]
    x = rows.index_select(0, index).float() + bias.view(n, 1, vocab)  # [P, W, V]
    x = torch.where(in_prompt | (counts > 0), torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    out = rows.to(torch.float32, copy=True)
    out.index_copy_(0, index, x)
    return out


def _count(at: torch.Tensor, size: int) -> torch.Tensor:
    """Occurrences of each flat index, float32 [size]; unlike torch.bincount, no host read on CUDA."""
    ones = torch.ones(at.shape, dtype=torch.float32, device=at.device)
    return torch.zeros(size, dtype=torch.float32, device=at.device).index_put_((at,), ones, accumulate=True)


def _cat(parts: list[np.ndarray], dtype: type = np.int64) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
