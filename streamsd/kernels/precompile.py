"""A first start's Triton compiles, spread over processes.

Most of a Triton compile is Python (the front end walks the kernel's AST and builds its IR) and
holds the GIL, so threads overlap only the LLVM and ptxas parts: on a 16-core host ~110 variants
compiled on threads still took 17-29 s of a cold start. Child processes have a GIL each. They run
the same variant tasks, whose compiles land in Triton's on-disk cache (shared through
TRITON_CACHE_DIR, which they inherit); the server's own warm-up then loads each variant from disk
instead of compiling it. A child is a fresh interpreter running this module (`python -m`), handed
its tasks pickled on stdin: unlike multiprocessing's spawn it never imports the caller's main script,
so a script that builds an engine at its top level, unguarded, does not run again in every child.

The children run while the server goes on (`start`, then `Compiling.wait` once their variants are
needed): the CUDA-graph capture, which compiles the variants only a capture reaches one by one on
its own thread, overlaps them instead of following them (on a first start on a 16-core host, 14 s of
children then 18 s of capture).

A restart finds the variants on disk already and spawns nothing: a marker file beside them, named
by a digest of the task list, the kernels' source and the compiler and device, records that this
exact set was compiled. A child that fails (no memory for its CUDA context, say) costs nothing but
time: whatever it left out, the warm-up compiles in-process as it always could.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import triton

log = logging.getLogger("streamsd")

MAX_PROCESSES = 8  # each holds a CUDA context (~0.5 GB) while it compiles
TASKS_PER_PROCESS = 8  # fewer, and a child's start-up (importing torch) costs more than it saves


def processes_for(n_tasks: int) -> int:
    """Child processes worth spawning for `n_tasks` compiles on this host: 0 where the host has too
    few cores for them to run beside the server's own threads."""
    cores = os.cpu_count() or 1
    n = min(MAX_PROCESSES, cores // 2, -(-n_tasks // TASKS_PER_PROCESS))
    return n if n >= 2 else 0


def device_name(device: torch.device) -> str:
    """What the compiled code depends on of the device: its name and compute capability."""
    return f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"


def marker(tasks: Sequence[partial[None]], device: str) -> Path | None:
    """The file that says these tasks' variants, compiled for `device` (device_name), are in Triton's
    cache (None: no cache directory set)."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        return None
    digest = hashlib.sha256()
    for line in (triton.__version__, torch.__version__, device, *map(_describe, tasks)):
        digest.update(line.encode() + b"\n")
    for source in sorted(Path(__file__).parent.rglob("*.py")):  # a kernel's change compiles it again
        digest.update(source.read_bytes())
    return Path(cache) / f"streamsd-variants-{digest.hexdigest()[:24]}"


@dataclass(frozen=True)
class Compiling:
    """Child processes compiling `tasks` variants, started by `start`."""

    children: list[subprocess.Popen[bytes]]
    tasks: int
    started: float  # perf_counter at the spawn

    def wait(self) -> tuple[int, float]:
        """Blocks until every child has exited; returns (processes spawned, seconds since the spawn).
        A child that failed leaves a warning: the warm-up compiles what it did not."""
        n = len(self.children)
        # One after another: a child's stderr is read once it exits, and a later one blocked on a full
        # pipe meanwhile only waits to be read.
        errors = [_last_line(err) for code, err in (_wait(c) for c in self.children) if code != 0]
        seconds = time.perf_counter() - self.started
        if errors:
            log.warning("compiling kernel variants in %d processes failed (%d of %d: %s); compiling them here",
                        n, len(errors), n, errors[0])
        else:
            log.info("compiled %d kernel variant tasks in %d processes in %.1fs", self.tasks, n, seconds)
        return n, seconds

    def stop(self) -> None:
        """Ends every child still running (a start that failed meanwhile): none outlives the server
        holding GPU memory that a restart would size its KV cache without."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()
            if child.stderr is not None:
                child.stderr.close()


def start(tasks: Sequence[partial[None]], device: torch.device, done: Path | None,
          processes: int | None = None) -> Compiling | None:
    """Starts `tasks` (picklable: partials of module functions) in child processes (`processes`, or
    as many as processes_for says), unless their marker `done` (`marker`) says a run before did.
    None: nothing started."""
    t0 = time.perf_counter()
    n = processes_for(len(tasks)) if processes is None else processes
    if done is None or done.exists() or n == 0:
        return None
    groups = [list(tasks[i::n]) for i in range(n)]  # round robin: each kind of kernel spread over all
    children: list[subprocess.Popen[bytes]] = []
    try:
        for group in groups:
            children.append(_spawn(group, device))
    except Exception as exc:  # the warm-up compiles what the children did not
        log.warning("starting %d processes to compile kernel variants failed (%s); compiling them here", n, exc)
    return Compiling(children, len(tasks), t0)


def mark_compiled(done: Path | None) -> None:
    """After a warm-up ran every task of marker `done` here: the next start need not spawn children
    for them."""
    if done is not None:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.touch()


def _describe(task: partial[None]) -> str:
    """A task as the same text in every process (a partial's repr holds its function's address)."""
    return f"{task.func.__module__}.{task.func.__qualname__}{task.args}{sorted(task.keywords.items())}"


def _spawn(tasks: list[partial[None]], device: torch.device) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    assert child.stdin is not None
    child.stdin.write(pickle.dumps((tasks, device)))
    child.stdin.close()
    return child


def _wait(child: subprocess.Popen[bytes]) -> tuple[int, bytes]:
    assert child.stderr is not None
    err = child.stderr.read()
    return child.wait(), err


def _last_line(err: bytes) -> str:
    lines = err.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"


def _run_group(tasks: list[partial[None]], device: torch.device) -> None:
    cuda = device.type == "cuda"
    if cuda and device.index is not None:  # else the current device, as in the parent
        torch.cuda.set_device(device)
    for task in tasks:
        task()
    if cuda:
        torch.cuda.synchronize(device)


if __name__ == "__main__":  # a child: its tasks and device come pickled on stdin
    _run_group(*pickle.loads(sys.stdin.buffer.read()))
