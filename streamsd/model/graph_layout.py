"""Where a CUDA graph's step lives in its static buffers: the packed host values of a step
(ids | positions | slots | context lengths | query starts), the layout a graph reads them through,
and a prompt graph's tail (the row it returns, its attention tiles). Shared by the target's graphs
(model/graphs.py), the tree graphs (worker/tree_graphs.py) and the head's (spec_decode/eagle/graphs.py,
spec_decode/eagle/grow_graphs.py)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from streamsd.model.kv_cache import BatchLayout

PROMPT_WIDTHS = (32, 64, 128, 256, 512, 1024)  # a prompt step's tokens pad to the next: at most 2x its rows
# Sequences a packed prompt graph holds (prompt chunks and the one-token rows beside them): the
# prompt steps of a loaded server admit a few requests among many decoding ones.
PROMPT_SEQS = 64
# A prompt step's attention tile (kernels/attention/prefill.py): (sequence, first row, tokens, first position,
# split, splits).
TILE_INTS = 6


def packed_size(bucket: int, width: int, slots: int | None = None) -> int:
    """Length of a (bucket, width) graph's packed values, 3T + 2B + 1; a prompt graph's tail starts there.
    `slots`: its token slots T, when not bucket * width (a packed prompt graph's: its width)."""
    return 3 * (bucket * width if slots is None else slots) + 2 * bucket + 1


def pack_step(ids: list[int] | None, starts: list[int], counts: list[int], tables: list[list[int]], bucket: int,
              width: int, scratch: int, block_size: int, slots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host values of one step for a (bucket, width) graph.

    Returns packed [3T + 2B + 1] int64 (ids | positions | slots | context lens | query starts, with
    T = bucket * width unless `slots` says otherwise, B = bucket) and the live block table
    [S, max table length] int32.
    """
    t_all, n_seq = bucket * width if slots is None else slots, len(counts)
    host = np.zeros(packed_size(bucket, width, t_all), dtype=np.int64)
    ids_h, pos_h, slot_h = host[:t_all], host[t_all : 2 * t_all], host[2 * t_all : 3 * t_all]
    ctx_h, qs_h = host[3 * t_all : 3 * t_all + bucket], host[3 * t_all + bucket :]
    table = np.zeros((n_seq, max((len(t) for t in tables), default=1)), dtype=np.int32)  # [S, w]
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    cnt = np.asarray(counts, dtype=np.int64)
    n_tok = int(cnt.sum())
    first = np.cumsum(cnt) - cnt  # [S] first flat token of each sequence
    pos = np.repeat(np.asarray(starts, dtype=np.int64), cnt) + np.arange(n_tok) - np.repeat(first, cnt)
    pos_h[:n_tok] = pos
    if n_tok:
        slot_h[:n_tok] = table[np.repeat(np.arange(n_seq), cnt), pos // block_size].astype(np.int64) * block_size \
            + pos % block_size
    slot_h[n_tok:] = scratch * block_size + np.arange(t_all - n_tok) % block_size
    ctx_h[:n_seq] = np.asarray(starts, dtype=np.int64) + cnt
    qs_h[:n_seq] = first
    qs_h[n_seq:] = n_tok
    if ids is not None:
        ids_h[:n_tok] = ids
    return host, table


def prompt_tile_count(width: int, heads: int, kv_heads: int) -> int:
    """Tiles of a prompt graph `width` rows wide (kernels/attention/prefill.py's, for this GQA group)."""
    from streamsd.kernels.attention.prefill import tokens_per_tile

    return -(-width // tokens_per_tile(heads, kv_heads))


def with_prompt_tail(host: np.ndarray, start: int, count: int, width: int, n_tiles: int, row: int) -> np.ndarray:
    """A prompt graph's host values: pack_step's for its one chunk, then the row whose logits (or
    output) it returns and the chunk's tiles."""
    return np.concatenate([host, [row], prompt_tiles(start, count, width, n_tiles)])


def prompt_tiles(start: int, count: int, width: int, n_tiles: int) -> np.ndarray:
    """A prompt graph's tiles [n_tiles * TILE_INTS] (kernels/attention/prefill.py's (sequence, first row,
    tokens, first position, split 0 of 1)) for `count` tokens from position `start`, padded to `width`
    rows: the tiles past the chunk hold no tokens and see no keys."""
    per = -(-width // n_tiles)
    off = np.arange(n_tiles, dtype=np.int64) * per
    tokens = np.clip(count - off, 0, per)
    zero = np.zeros_like(off)
    return np.stack([zero, off, tokens, np.where(tokens > 0, start + off, 0), zero, zero + 1], axis=1).reshape(-1)


def packed_prompt_tail(host: np.ndarray, starts: list[int], counts: list[int], rows: list[int], bucket: int,
                       per_tile: int, n_tiles: int, kv_heads: int, sms: int) -> np.ndarray:
    """A packed prompt graph's host values: pack_step's, then the `bucket` rows whose logits it
    returns (those asked for, then row 0 again) and the tiles of every sequence's tokens,
    `per_tile` tokens a tile (kernels/attention/prefill.py's, their keys split as `split_tiles` does
    for `kv_heads` and `sms`), padded with empty tiles to `n_tiles`."""
    from streamsd.kernels.attention.prefill import prefill_tiles, split_tiles  # the eager step's tiles

    firsts = [0, *itertools.accumulate(counts)][:-1]  # each sequence's first row in the packed slots
    found = prefill_tiles(firsts, counts, [s + c for s, c in zip(starts, counts, strict=True)], 0, per_tile)
    found = split_tiles(found, kv_heads, sms, n_tiles)
    tiles = np.zeros((n_tiles, TILE_INTS), dtype=np.int64)
    tiles[: len(found)] = found
    row_tail = np.zeros(bucket, dtype=np.int64)
    row_tail[: len(rows)] = rows
    return np.concatenate([host, row_tail, tiles.reshape(-1)])


def packed_prompt_tiles(slots: int, bucket: int, per_tile: int) -> int:
    """Tiles a packed prompt graph holds: its sequences' tokens (at most `slots`, in at most
    `bucket` sequences) cut `per_tile` at a time. Each sequence's last tile may be partial, and
    ceil(a) + ceil(b) <= ceil(a + b) + 1, so ceil(slots / per_tile) + bucket - 1 always suffice."""
    return -(-slots // per_tile) + bucket - 1


def static_layout(packed: torch.Tensor, block_table: torch.Tensor, bucket: int, width: int,
                  scratch: int, slots: int | None = None) -> tuple[torch.Tensor, BatchLayout]:
    """Views of a packed buffer as (ids [T], BatchLayout). The host lists only steer the attention
    dispatch (every sequence short: the kernel runs); the kernel reads the device tensors."""
    t_all = bucket * width if slots is None else slots
    layout = BatchLayout(
        positions=packed[t_all : 2 * t_all], slot_mapping=packed[2 * t_all : 3 * t_all],
        query_starts=[i * width for i in range(bucket)], query_lens=[width] * bucket,
        context_lens=[width] * bucket, block_tables=[[scratch]] * bucket, block_table=block_table,
        context_lens_t=packed[3 * t_all : 3 * t_all + bucket],
        query_starts_t=packed[3 * t_all + bucket : packed_size(bucket, width, t_all)],
    )
    return packed[:t_all], layout
