"""Where one decode step's GPU time goes: graph replay time vs the HBM floor, and the kernels of
one eager step grouped by name (CUDA profiler). Usage: python3 scripts/profile_step.py [preset] [B]"""

from __future__ import annotations

import sys
import time

import torch

from streamsd.bench.offline_run import floor_step_ms
from streamsd.model.kv_cache import PagedKVCache
from streamsd.model.presets import build_preset
from streamsd.worker.graphs import GraphConfig, GraphRunner, forward_logits


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 1
    ctx = 128
    dev, dtype = torch.device("cuda"), torch.bfloat16
    model, _ = build_preset(name, dev, dtype)
    from streamsd.kernels.attention.paged import cuda_attention
    from streamsd.model.fast_forward import enable_fast_forward

    model.attend = cuda_attention
    if "--unfused" not in sys.argv:
        enable_fast_forward(model)
    blocks_per_seq = ctx // 16 + 1
    scratch = batch * blocks_per_seq
    cache = PagedKVCache(model.args, scratch + 1, 16, dtype, dev)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    args = ([1] * batch, [ctx] * batch, [1] * batch, tables, list(range(batch)), dev)
    runner = GraphRunner(model, cache, scratch, GraphConfig(max_blocks=blocks_per_seq + 1), dev)
    for graphs, label in ((runner, "graph"), (None, "eager")):
        for _ in range(3):
            forward_logits(model, graphs, cache, *args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            forward_logits(model, graphs, cache, *args)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / 20
        floor = floor_step_ms(model.args, dtype, batch, ctx)
        print(f"{name} B={batch} ctx={ctx} {label}: {ms:.3f} ms/step, floor {floor:.3f} ms, ratio {ms / floor:.2f}")
    g = runner.graphs[runner.key_for([1] * batch, tables)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        g.graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"pure replay (no host prep): {start.elapsed_time(end) / 20:.3f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward_logits(model, None, cache, *args)
        torch.cuda.synchronize()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60))
            break
        except Exception as exc:  # the sort key's name moved between torch versions
            print(f"(profile table by {key} failed: {exc})")


if __name__ == "__main__":
    main()
