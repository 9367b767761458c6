"""Megatron-style tensor parallelism for the Llama forward (model/llama.py, model/fast_forward.py).

Each of N ranks holds 1/N of every layer: q/k/v and gate/up column-parallel (its own query and kv
heads, its slice of the intermediate width), o_proj and down_proj row-parallel, each followed by an
all_reduce of the residual update; the embedding and lm_head are split by vocabulary rows (the
embedding masks ids outside its rows and all_reduces, the lm_head all_gathers to the full logits).
The residual stream is the same on every rank, so norms and RoPE run unsplit, and the streams
rank 0 captures (an EAGLE head's input) are whole. Each rank's paged KV
cache holds only its kv heads; block tables and slots are the same on every rank.

`load_shard` reads only a rank's slices from the safetensors (safe_open + get_slice, memory-mapped),
never the whole model.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from streamsd.model.arch import ModelArgs
from streamsd.model.kv_cache import BatchLayout

#: Rank 0's hook, called with a forward's inputs before it runs: hands them to the other ranks.
Announce = Callable[[torch.Tensor, BatchLayout, torch.Tensor], None]

# HF parameter name -> the dimension it is split along (0: output rows, 1: input columns).
_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class RankLost(RuntimeError):
    """A rank of a tensor-parallel group is gone: the group cannot compute another step."""


def shard_args(args: ModelArgs, world: int) -> ModelArgs:
    """One rank's layer shapes; a ValueError when `world` does not divide the head counts."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, not {world}")
    if args.num_heads % world or args.num_kv_heads % world or args.intermediate_size % world:
        raise ValueError(
            f"tensor_parallel_size {world} must divide the model's attention heads ({args.num_heads}), "
            f"kv heads ({args.num_kv_heads}) and intermediate size ({args.intermediate_size})")
    return dataclasses.replace(args, num_heads=args.num_heads // world, num_kv_heads=args.num_kv_heads // world,
                               intermediate_size=args.intermediate_size // world,
                               vocab_size=-(-args.vocab_size // world))


class Comm:
    """The collectives of one group of ranks over a process group of its own, not torch.distributed's
    global default group: a process may hold several engines' groups, one after another or at once."""

    def __init__(self, pg: Any, store: Any, rank: int, world: int, join_timeout: timedelta):
        self.pg = pg
        self.store = store
        self.rank = rank
        self.world = world
        self.join_timeout = join_timeout

    @staticmethod
    def connect(backend: str, port: int, rank: int, world: int, timeout: timedelta,
                check: Callable[[], None] | None = None, join_timeout: timedelta = timedelta(minutes=10)) -> Comm:
        """Joins the group whose rank 0 listens on 127.0.0.1:`port`; `timeout` bounds every collective,
        `join_timeout` the wait for the other ranks to start (a loaded host imports slowly). Rank 0
        calls `check` while it waits for them: it raises for one that never will (a process that died
        first), where the store's own wait would last the whole timeout."""
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, join_timeout, wait_for_workers=False)
        Comm.meet(store, "joined", rank, world, join_timeout, check)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg: Any = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            pg = dist.ProcessGroupGloo(store, rank, world, timeout)
        return Comm(pg, store, rank, world, join_timeout)

    def ready(self, check: Callable[[], None] | None = None) -> None:
        """Every rank has loaded its shard: rank 0 waits for the others (watching them with `check`)
        up to the join timeout, not the collectives' (loading a shard takes as long as it takes)."""
        Comm.meet(self.store, "loaded", self.rank, self.world, self.join_timeout, check)

    @staticmethod
    def meet(store: Any, key: str, rank: int, world: int, timeout: timedelta,
             check: Callable[[], None] | None) -> None:
        """Ranks > 0 check in under `key`; rank 0 waits until all have, calling `check` meanwhile."""
        if rank > 0:
            store.add(key, 1)
            return
        deadline = time.monotonic() + timeout.total_seconds()
        while store.add(key, 0) < world - 1:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other ranks did not reach {key!r} within {timeout.total_seconds():.0f}s")
            time.sleep(0.05)

    def all_reduce(self, x: torch.Tensor) -> None:
        self.pg.allreduce([x]).wait()

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        self.pg.allgather([parts], [x]).wait()

    def broadcast(self, x: torch.Tensor) -> None:
        """From rank 0 to every rank, in place."""
        self.pg.broadcast([x], dist.BroadcastOptions()).wait()


@dataclass(frozen=True, slots=True)
class TensorShard:
    """This rank's place in the group and the collectives of the sharded forward."""

    rank: int
    world: int
    vocab_size: int  # the full vocabulary; each rank holds ceil(V / world) rows, the last padded
    group: Comm
    announce: Announce | None = None  # rank 0 only (worker/tp.py)
    # Rank 0 only: given a failed collective, the RankLost naming the rank that is gone (or None).
    diagnose: Callable[[BaseException], RankLost | None] | None = None

    @property
    def vocab_rows(self) -> int:
        return -(-self.vocab_size // self.world)

    def begin(self, input_ids: torch.Tensor, layout: BatchLayout, logits_rows: torch.Tensor) -> None:
        """Before a forward: rank 0 announces it, with the rows whose logits its lm_head computes, so
        that every rank computes those rows of its vocabulary slice. Whatever else rank 0 does with the
        forward (captures streams, writes a stream store) needs nothing from the others."""
        if self.announce is not None:
            self._guard(lambda: self.announce(input_ids, layout, logits_rows))  # type: ignore[misc]

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel layer's partial outputs, in place."""
        self._guard(lambda: self.group.all_reduce(x))
        return x

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden] from this rank's vocabulary rows `table` and the others'."""
        local = ids - self.rank * self.vocab_rows
        outside = (local < 0) | (local >= table.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0)
        return self.reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[N, V / world] on each rank -> the full [N, V]."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self._guard(lambda: self.group.all_gather(parts, local.contiguous()))
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def _guard(self, collective: Callable[[], Any]) -> None:
        try:
            collective()
        except RankLost:
            raise
        except Exception as exc:  # gloo and NCCL raise their own RuntimeError kinds
            lost = self.diagnose(exc) if self.diagnose is not None else None
            if lost is not None:
                raise lost from exc
            raise


def load_shard(files: list[Path], args: ModelArgs, rank: int, world: int, dtype: torch.dtype,
               device: torch.device) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of every tensor in `files` (HF names), floats cast to dtype."""
    from safetensors import safe_open

    rows = -(-args.vocab_size // world)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                part = reader.get_slice(name)
                shape = part.get_shape()
                if _COLUMN.search(name):
                    n = shape[0] // world
                    t = part[rank * n : (rank + 1) * n]
                elif _ROW.search(name):
                    n = shape[1] // world
                    t = part[:, rank * n : (rank + 1) * n]
                elif name in _VOCAB:
                    t = part[rank * rows : min((rank + 1) * rows, shape[0])]
                    if t.shape[0] < rows:  # the last rank's padding rows: never looked up, logits cut
                        t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
                else:
                    t = part[:]
                state[name] = (t.to(dtype) if t.is_floating_point() else t).to(device)
    return state
