"""One token's logits computed in steps of many shapes, for the exact mode's invariance tests: alone,
as a prompt chunk's row, in a verify window, and among 5, 25 or 64 rows of other sequences at
several places. Device-agnostic: the CPU's exact forward, the Triton kernels under the interpreter
and the CUDA path all run the same cases."""

from __future__ import annotations

import random

import torch

from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.model.llama import Transformer

BS = 16
PROMPT = 37  # tokens before the checked one


class Steps:
    """A fresh cache and block tables per case, so that no case reads another's KV."""

    def __init__(self, model: Transformer, device: torch.device, dtype: torch.dtype, num_blocks: int = 160):
        self.model, self.device = model, device
        self.cache = PagedKVCache(model.args, num_blocks, BS, dtype, device)
        self.free = list(range(num_blocks))[::-1]
        self.tables: dict[int, list[int]] = {}

    def run(self, chunks: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
        """chunks: (sequence, first position, tokens) -> every token's logits, per chunk."""
        ids, starts, counts, tables = [], [], [], []
        for sid, start, toks in chunks:
            table = self.tables.setdefault(sid, [])
            while len(table) * BS < start + len(toks):
                table.append(self.free.pop())
            ids += toks
            starts.append(start)
            counts.append(len(toks))
            tables.append(table)
        layout = BatchLayout.build(starts, counts, tables, BS, self.device)
        rows = torch.arange(len(ids), device=self.device)
        out = self.model(torch.tensor(ids, device=self.device), layout, self.cache, rows)
        return list(torch.split(out.logits.float().cpu(), counts))


def checked_row_logits(model: Transformer, device: torch.device, dtype: torch.dtype,
                       batch_sizes: tuple[int, ...] = (5, 25, 64)) -> dict[str, torch.Tensor]:
    """The logits of the token at position PROMPT of one sequence, per way of computing it."""
    g = random.Random(0)
    vocab = model.args.vocab_size
    prompt = [g.randrange(3, vocab) for _ in range(PROMPT)]
    x = g.randrange(3, vocab)
    others = [[g.randrange(3, vocab) for _ in range(1 + (i % 3 == 0) * 2)] for i in range(max(batch_sizes))]
    out: dict[str, torch.Tensor] = {}

    s = Steps(model, device, dtype)
    out["prompt row"] = s.run([(0, 0, prompt + [x])])[0][-1]
    s = Steps(model, device, dtype)
    s.run([(0, 0, prompt)])
    out["decode alone"] = s.run([(0, PROMPT, [x])])[0][0]
    s = Steps(model, device, dtype)
    s.run([(0, 0, prompt[:-3])])
    out["verify window"] = s.run([(0, PROMPT - 3, prompt[-3:] + [x])])[0][-1]
    for m in batch_sizes:
        for where in sorted({0, m // 2, m - 1}):
            s = Steps(model, device, dtype)
            s.run([(0, 0, prompt)])
            chunks, rows = [], 1
            for i, toks in enumerate(others):  # fresh sequences' first tokens, some three at a time
                if rows + len(toks) > m:
                    toks = toks[: m - rows]
                if not toks:
                    break
                chunks.append((i + 1, 0, toks))
                rows += len(toks)
            chunks.insert(min(where, len(chunks)), (0, PROMPT, [x]))
            result = s.run(chunks)
            out[f"decode among {m} rows at {where}"] = result[min(where, len(chunks) - 1)][0]
    s = Steps(model, device, dtype)
    s.run([(0, 0, prompt[:-1])])
    result = s.run([(1, 0, others[0]), (0, PROMPT - 1, prompt[-1:] + [x]), (2, 0, others[3])])
    out["verify window among others"] = result[1][-1]
    return out


def differing(logits: dict[str, torch.Tensor]) -> list[str]:
    """The cases whose logits are not the first case's bits."""
    first = next(iter(logits.values()))
    return [name for name, t in logits.items() if not torch.equal(t, first)]
