"""The first start's compiles in child processes (kernels/precompile.py): the marker that lets a
restart skip them is the same in every process and changes with what it stands for, and children
that fail cost the start nothing but the warning."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from streamsd.kernels import precompile as pc
from streamsd.kernels import warmup as wu
from streamsd.kernels.warmup import WarmUp, _paged_variant, _rejection_variant, variant_tasks

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _tasks(k: int = 4) -> list[partial[None]]:
    return [partial(_paged_variant, (9, 3, 64), torch.bfloat16, 16, torch.device("cuda", 0), 1, 2, False),
            partial(_rejection_variant, k, True, False, 49152, torch.device("cuda", 0))]


def test_the_marker_names_the_same_file_in_another_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    here = pc.marker(_tasks(), "GPU (9, 0)")
    assert here is not None and here.parent == tmp_path
    code = ("import sys; sys.path.insert(0, '.'); from tests.kernels.test_precompile import _tasks; "
            "from streamsd.kernels.precompile import marker; print(marker(_tasks(), 'GPU (9, 0)'))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={"TRITON_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout.strip()
    assert there == str(here)


def test_the_marker_changes_with_the_tasks_and_the_device(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    names = {pc.marker(_tasks(4), "GPU (9, 0)"), pc.marker(_tasks(5), "GPU (9, 0)"), pc.marker(_tasks(4), "GPU (8, 0)")}
    assert len(names) == 3


def test_no_cache_directory_no_marker_and_no_children(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert pc.marker(_tasks(), "GPU (9, 0)") is None
    assert pc.start(_tasks(), CPU, pc.marker(_tasks(), "GPU (9, 0)"), processes=2) is None


def test_children_that_fail_leave_a_warning_and_no_marker(tmp_path, monkeypatch, caplog):
    """Here the children cannot reach the device they are given: the start goes on, and a later one
    tries again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="streamsd"):
        compiling = pc.start(_tasks(), torch.device("cuda", 99), pc.marker(_tasks(), "GPU (9, 0)"), processes=2)
        assert compiling is not None
        spawned, _ = compiling.wait()
    assert spawned == 2
    assert "compiling them here" in caplog.text
    assert not pc.marker(_tasks(), "GPU (9, 0)").exists()


def test_children_run_their_tasks_and_never_the_callers_script(tmp_path):
    """A script that compiles at its top level, with no `__main__` guard: it runs once, not once more
    in every child, and the children's tasks run."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys, torch\n"
        "from functools import partial\n"
        "from streamsd.kernels import precompile as pc\n"
        f"open({str(tmp_path / 'runs')!r}, 'a').write('run\\n')\n"
        f"tasks = [partial(pc.mark_compiled, pc.Path({str(tmp_path)!r}) / f'task{{i}}') for i in range(4)]\n"
        "print(pc.start(tasks, torch.device('cpu'), pc.marker(tasks, 'CPU'), processes=2).wait())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"TRITON_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout
    assert out.startswith("(2, ")
    assert (tmp_path / "runs").read_text() == "run\n"
    assert sorted(p.name for p in tmp_path.glob("task*")) == ["task0", "task1", "task2", "task3"]


def _wait_for(flag: str, then: str) -> None:
    """A child's task: waits (at most 60 s) for the file `flag`, then writes `then`."""
    deadline = time.monotonic() + 60
    while not Path(flag).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(flag)
        time.sleep(0.01)
    Path(then).touch()


def test_the_caller_works_while_the_children_compile(tmp_path, monkeypatch):
    """`start` returns with the children running: each child's task waits for a file the caller
    writes after `start` (the capture, in a server), and all of them are done once `wait` returns."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.chdir(ROOT)  # the children import this module from here
    tasks = [partial(_wait_for, str(tmp_path / "go"), str(tmp_path / f"done{i}")) for i in range(4)]
    compiling = pc.start(tasks, CPU, pc.marker(tasks, "CPU"), processes=2)
    assert compiling is not None and len(compiling.children) == 2
    (tmp_path / "go").touch()
    assert compiling.wait()[0] == 2
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done1", "done2", "done3"]


def test_children_of_a_start_that_failed_are_ended(tmp_path, monkeypatch):
    """A start that fails while the children compile (say, out of memory capturing the graphs) ends
    them: each child's task here waits for a file nobody writes, and `stop` returns with every child
    gone, none of them having finished, and no marker."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.chdir(ROOT)
    tasks = [partial(_wait_for, str(tmp_path / "never"), str(tmp_path / f"done{i}")) for i in range(4)]
    compiling = pc.start(tasks, CPU, pc.marker(tasks, "CPU"), processes=2)
    assert compiling is not None and all(c.poll() is None for c in compiling.children)
    started = time.monotonic()
    compiling.stop()
    assert time.monotonic() - started < 10  # not the tasks' 60 s
    assert all(c.returncode is not None for c in compiling.children)
    assert not list(tmp_path.glob("done*")) and not pc.marker(tasks, "CPU").exists()


def test_a_marked_set_spawns_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pc.mark_compiled(pc.marker(_tasks(), "GPU (9, 0)"))
    assert pc.start(_tasks(), torch.device("cuda", 0), pc.marker(_tasks(), "GPU (9, 0)"), processes=2) is None


def test_processes_stay_within_half_the_cores_and_the_cap():
    n = pc.processes_for(1000)
    assert n == 0 or 2 <= n <= pc.MAX_PROCESSES
    assert pc.processes_for(3) == 0  # too few tasks to pay for a child's start


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_warm_up_runs_its_tasks_in_order_on_the_calling_thread(tmp_path):
    """A variant's first launch loads Triton's launcher for its signature, and every launcher module has
    the same name: loaded from two threads at once, a launch can go through another kernel's launcher."""
    seen: list[tuple[int, int]] = []
    tasks = [partial(lambda i: seen.append((i, threading.get_ident())), i) for i in range(6)]
    WarmUp(tasks, torch.device("cuda", 0), tmp_path / "marker", None).finish()
    assert seen == [(i, threading.get_ident()) for i in range(6)]
    assert (tmp_path / "marker").exists()


@pytest.mark.parametrize("trees", [False, True])
def test_every_kernel_variant_is_one_task_once(trees):
    """The warm-up's list names each variant once (a repeat would be loaded twice, and compiled twice by
    two children) and has a task for every kernel a step launches."""
    dev = torch.device("cuda", 0)  # only named: nothing runs
    tasks = variant_tasks([(9, 3, 64), (12, 4, 64)], torch.bfloat16, 16, 49152, 4, dev, trees, (9, 3, 64))
    keys = [(t.func, t.args) for t in tasks]
    assert len(keys) == len(set(keys))
    assert {t.func for t in tasks} == {wu._sampling_variants, wu._paged_variant, wu._prefill_variant,
                                       wu._exact_variant, wu._rejection_variant, wu._restart_variant}
    assert sum(t.func is wu._exact_variant for t in tasks) == (2 if trees else 1)
    assert [t.args[0] for t in tasks if t.func is wu._restart_variant] == [1, 2, 3, 4]
