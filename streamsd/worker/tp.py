"""Tensor parallelism's processes: rank 0 is the engine's own worker (a thread of the main process);
ranks 1..N-1 are follower processes (torch.multiprocessing, spawn) that each hold 1/N of the target
(model/parallel.py) and run its forward in lockstep with rank 0.

Per target forward rank 0 broadcasts the forward's inputs before it runs: a fixed header (what
follows and its sizes) and one int64 payload (token ids, positions, KV slots, the block table,
context lengths, query starts, the logits rows, and for a step that verifies draft trees their
window masks and starts): two broadcasts a forward, then the forward's own
collectives (two all_reduces a layer, one for the embedding, one all_gather of the logits). The
one change to the KV cache outside a forward, a verified tree's accepted nodes moved to their
positions, is announced the same way (`GroupKVCache`): a header, then the slots to move. An
engine step runs one target forward, so it costs two broadcasts; a draft model's forwards run on
rank 0 alone and cost none. The scheduler, the proposers, sampling and verification stay on rank 0,
which alone reads the logits. An EAGLE head runs on rank 0 too: the residual streams it reads are
whole on every rank, and it holds its own full copies of the embedding and lm_head it shares with
the target (spec_decode/eagle/borrowed.py), which the ranks split.

Supervision: a monitor thread waits on the followers' sentinels; a follower that exits ends the
group (`RankLost`, naming the rank) instead of leaving rank 0 blocked in a collective, and the
process group's timeout bounds any collective a silent rank never joins. `close` stops every
follower and joins it.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.context import SpawnProcess
from pathlib import Path

import torch
import torch.multiprocessing as mp

from streamsd.config import BLOCK_SIZE
from streamsd.model.arch import ModelArgs
from streamsd.model.kv_cache import BatchLayout, PagedKVCache, h2d
from streamsd.model.llama import Transformer
from streamsd.model.loader import load_config, weight_files
from streamsd.model.parallel import Comm, RankLost, TensorShard, load_shard, shard_args

log = logging.getLogger("streamsd")

_FORWARD, _STOP, _MOVE = 1, 0, 2
# A forward's: op, tokens, sequences, block-table width, logits rows, draft trees (0/1); a move's: op, slots.
_HEADER = 6


@dataclass(frozen=True, slots=True)
class FollowerSpec:
    """What a follower process needs to join the group and load its shard (picklable)."""

    rank: int
    world: int
    model_dir: str
    dtype: str  # a torch dtype's name: "float32", "bfloat16", ...
    device_type: str  # "cpu" or "cuda" (a follower uses cuda:rank)
    port: int  # rank 0's rendezvous on 127.0.0.1
    timeout_s: float
    threads: int


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def build_shard(model_dir: Path, comm: Comm, rank: int, world: int, device: torch.device, dtype: torch.dtype,
                announce: Callable[[torch.Tensor, BatchLayout, torch.Tensor], None] | None = None,
                diagnose: Callable[[BaseException], RankLost | None] | None = None) -> Transformer:
    """This rank's share of the model in `model_dir`, reading only its slices of the weights."""
    args = ModelArgs.from_config(load_config(model_dir))
    shard_args(args, world)  # the head counts divide, else a clear error before any weight is read
    state = load_shard(weight_files(model_dir), args, rank, world, dtype, device)
    tp = TensorShard(rank, world, args.vocab_size, comm, announce=announce, diagnose=diagnose)
    model = Transformer.build(args, state, device, dtype, tp=tp)
    use_kernels(model, device)
    return model


def use_kernels(model: Transformer, device: torch.device) -> None:
    """The Triton attention and fused layers on CUDA, where the head dimension tiles (as worker/cuda.py)."""
    d = model.args.head_dim
    if device.type != "cuda" or not d or d & (d - 1):
        return
    from streamsd.kernels.attention.paged import paged_attention
    from streamsd.model.fast_forward import enable_fast_forward

    model.attend = paged_attention
    enable_fast_forward(model)


def follower_main(spec: FollowerSpec) -> None:
    """A follower's life: join the group, load its shard, size its cache as rank 0 says, then run
    every forward rank 0 announces until it says stop (or the group breaks)."""
    # Ctrl-C, or a SIGTERM sent to every process of the server (systemd's control group), is rank 0's
    # to act on: it drains, then stops the followers. A follower whose rank 0 is gone exits when its
    # next collective fails.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    device = rank_device(spec.device_type, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = Comm.connect(backend_for(device), spec.port, spec.rank, spec.world, timedelta(seconds=spec.timeout_s))
    dtype = getattr(torch, spec.dtype)
    model = build_shard(Path(spec.model_dir), comm, spec.rank, spec.world, device, dtype)
    comm.ready()
    blocks = torch.zeros(1, dtype=torch.int64, device=device)
    comm.broadcast(blocks)
    cache = PagedKVCache(model.layer_args, int(blocks.item()), BLOCK_SIZE, dtype, device)
    while True:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
        comm.broadcast(header)
        op, *sizes = header.tolist()
        if op == _STOP:
            return
        if op == _MOVE:
            moves = torch.empty(2 * sizes[0], dtype=torch.int64, device=device)
            comm.broadcast(moves)
            cache.move(*moves.chunk(2))
            continue
        ids, layout, rows = _receive(comm, device, cache.block_size, sizes)
        model(ids, layout, cache, rows)


def _receive(comm: Comm, device: torch.device, block_size: int, sizes: list[int]
             ) -> tuple[torch.Tensor, BatchLayout, torch.Tensor]:
    """A forward's inputs, after its header's sizes."""
    t, s, w, n, trees = sizes
    payload = torch.empty(3 * t + s * w + 2 * s + 1 + n + trees * (t + s), dtype=torch.int64, device=device)
    comm.broadcast(payload)
    ids, pos, slots, table, ctx, qs, rows, *tree = payload.split([t, t, t, s * w, s, s + 1, n] + [t, s] * trees)
    ctx_l, qs_l = ctx.tolist(), qs.tolist()
    table = table.view(s, w)
    tables = [row[: -(-c // block_size)] for row, c in zip(table.tolist(), ctx_l, strict=True)]
    layout = BatchLayout(pos, slots, qs_l[:-1], [b - a for a, b in zip(qs_l, qs_l[1:], strict=False)], ctx_l,
                         tables, table.to(torch.int32), ctx.to(torch.int32), qs.to(torch.int32),
                         *(tree or (None, None)))
    return ids, layout, rows


class TensorGroup:
    """Rank 0's side of the group: starts and supervises the followers, announces each forward."""

    def __init__(self, world: int, device: torch.device, timeout_s: float):
        self.world = world
        self.device = device
        self.timeout_s = timeout_s
        self.procs: list[SpawnProcess] = []  # ranks 1..N-1
        self.comm: Comm | None = None
        self.lost: RankLost | None = None
        self.on_lost: list[Callable[[str], None]] = []  # told once, from the monitor thread
        self._closing = threading.Event()
        self._lock = threading.Lock()
        # The monitor, a failed collective and close all reap followers: two threads in waitpid for one
        # child leave one of them with ECHILD and an exit code of None, the exit unseen.
        self._reaping = threading.Lock()

    @staticmethod
    def start(model_dir: Path, world: int, device: torch.device, dtype: torch.dtype, threads: int,
              timeout_s: float = 300.0) -> tuple[TensorGroup, Transformer]:
        """Spawns ranks 1..world-1, joins the group as rank 0 and loads rank 0's shard."""
        args = ModelArgs.from_config(load_config(model_dir))
        shard_args(args, world)  # before any process starts
        gpus = torch.cuda.device_count() if device.type == "cuda" else world
        if gpus < world:
            raise ValueError(f"tensor_parallel_size {world} runs one rank a GPU; this host has {gpus}")
        group = TensorGroup(world, device, timeout_s)
        port = _free_port()
        ctx = mp.get_context("spawn")
        for rank in range(1, world):
            spec = FollowerSpec(rank, world, str(model_dir), str(dtype).removeprefix("torch."), device.type, port,
                                timeout_s, threads)
            proc = ctx.Process(target=follower_main, args=(spec,), name=f"streamsd-tp{rank}", daemon=True)
            proc.start()
            group.procs.append(proc)
        threading.Thread(target=group._monitor, name="streamsd-tp-monitor", daemon=True).start()
        try:
            group.comm = Comm.connect(backend_for(device), port, 0, world, timedelta(seconds=timeout_s),
                                      group.raise_if_lost)
            model = build_shard(model_dir, group.comm, 0, world, device, dtype, group.announce, group.diagnose)
            group.comm.ready(group.raise_if_lost)
        except BaseException:
            group.close()
            raise
        log.info("tensor parallel: %d ranks over %s (%s), this process rank 0", world,
                 f"cuda:0..{world - 1}" if device.type == "cuda" else "the CPU", backend_for(device))
        return group, model

    def share_blocks(self, num_blocks: int) -> None:
        """Every follower allocates a KV cache of `num_blocks` blocks (its kv heads), as rank 0 did."""
        self._broadcast(torch.tensor([num_blocks], dtype=torch.int64, device=self.device))

    def kv_cache(self, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype) -> GroupKVCache:
        """Rank 0's KV cache of `num_blocks` blocks (`args`: its kv heads), each follower holding its own."""
        self.share_blocks(num_blocks)
        return GroupKVCache(self, args, num_blocks, block_size, dtype, self.device)

    def announce_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every follower moves its KV at flat slots src [M] to dst [M] (GroupKVCache.move)."""
        if self.lost is not None:
            raise RankLost(str(self.lost))
        if not src.numel():
            return
        self._broadcast(h2d([_MOVE, src.numel(), 0, 0, 0, 0], torch.int64, self.device))
        self._broadcast(torch.cat([src, dst]).to(device=self.device, dtype=torch.int64))

    def announce(self, input_ids: torch.Tensor, layout: BatchLayout, logits_rows: torch.Tensor) -> None:
        """Hands one target forward's inputs to every follower (TensorShard.begin calls it)."""
        if self.lost is not None:
            raise RankLost(str(self.lost))
        s, w = layout.block_table.shape
        t, n = input_ids.numel(), logits_rows.numel()
        # Non-blocking from the host, the payload from the device: a step queued ahead (worker/lookahead.py)
        # announces its sampled ids without waiting for them.
        trees: list[torch.Tensor] = []
        if layout.tree_bits is not None:  # a step verifying draft trees: each row's window mask, each window's start
            assert layout.tree_start is not None
            trees = [layout.tree_bits, layout.tree_start]
        self._broadcast(h2d([_FORWARD, t, s, w, n, int(bool(trees))], torch.int64, self.device))
        parts = [input_ids, layout.positions, layout.slot_mapping, layout.block_table.flatten(), layout.context_lens_t,
                 layout.query_starts_t, logits_rows, *trees]
        self._broadcast(torch.cat([p.to(device=self.device, dtype=torch.int64) for p in parts]))

    def diagnose(self, exc: BaseException) -> RankLost | None:
        """The RankLost behind a failed collective: a follower that exited (waited for briefly, as
        the collective can fail before the monitor sees the exit), else the failure itself (a rank
        that stopped answering: the timeout). Either way the ranks are out of step for good."""
        if self.lost is None and not self._closing.is_set():
            multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=5.0)
            if not self._note_exits():
                self._lose(f"a tensor-parallel collective failed ({exc}); the engine cannot continue")
        return RankLost(str(self.lost)) if self.lost is not None else None

    def raise_if_lost(self) -> None:
        if self._note_exits():
            raise RankLost(str(self.lost))

    def close(self) -> None:
        """Stops every follower (an orderly stop when the group is whole) and joins it."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.lost is None and self.comm is not None:
            try:
                self._broadcast(torch.tensor([_STOP, 0, 0, 0, 0, 0], dtype=torch.int64, device=self.device))
            except Exception as exc:  # a follower gone meanwhile: it is reaped below
                log.warning("tensor parallel: stopping the followers: %s", exc)
        with self._reaping:
            for proc in self.procs:
                proc.join(timeout=10.0)
                if proc.is_alive():
                    proc.kill()  # a follower ignores SIGTERM (follower_main)
                    proc.join(timeout=5.0)
        self.comm = None

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            assert self.comm is not None, "the group has not started or has closed"
            self.comm.broadcast(t)
        except Exception as exc:
            lost = self.diagnose(exc)
            if lost is not None:
                raise lost from exc
            raise

    def _monitor(self) -> None:
        pending = {p.sentinel: p for p in self.procs}
        while pending and not self._closing.is_set():
            for sentinel in multiprocessing.connection.wait(list(pending), timeout=1.0):
                # typeshed's wait() returns any waitable kind, not the kind given: these are the sentinels.
                pending.pop(sentinel)  # type: ignore[arg-type]
            if self._closing.is_set() or self._note_exits():
                return

    def _note_exits(self) -> bool:
        """Records the first follower found exited; True when the group is (newly or already) lost."""
        with self._reaping:
            ended = set(multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=0))
            for proc in self.procs:
                if proc.sentinel in ended:
                    # The sentinel closes as the process exits, a moment before its exit status exists:
                    # join (waitpid) reads it, where exitcode alone may still say None.
                    proc.join(timeout=5.0)
            exited = next(((rank, proc.exitcode) for rank, proc in enumerate(self.procs, start=1)
                           if proc.exitcode is not None), None)
        if exited is not None:  # told outside the lock: a listener may close the group, which reaps too
            self._lose(f"tensor-parallel rank {exited[0]} exited (exit code {exited[1]}); the engine cannot continue")
        return self.lost is not None

    def _lose(self, message: str) -> None:
        """The group is lost: said once, to the log and to every `on_lost` listener."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = RankLost(message)
        log.error("%s", message)
        for tell in self.on_lost:
            tell(message)


class GroupKVCache(PagedKVCache):
    """Rank 0's KV cache: besides the forwards, which every rank runs, the one change made to a cache
    outside them, a verified draft tree's accepted nodes moved to their positions (sample/tree_verify.py),
    is announced, and every follower moves its kv heads' K/V alike."""

    def __init__(self, group: TensorGroup, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(args, num_blocks, block_size, dtype, device)
        self.group = group

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.announce_move(src, dst)
        super().move(src, dst)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_threads(world: int) -> int:
    """CPU threads per rank: the cores but one, shared among the ranks."""
    return max(1, ((os.cpu_count() or 2) - 1) // world)
