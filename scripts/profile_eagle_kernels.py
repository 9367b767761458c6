"""Where an eagle step's GPU time goes, kernel by kernel, against a plain step: the real model and
head, batch 1, CUDA graphs, through the CUDA profiler. Prints per engine and temperature the wall
ms per step, the GPU ms per step (sum of kernel times), the kernels by total time per step, and the
host's CUDA runtime calls by time per step (a wait in cudaStreamSynchronize or a blocking copy is
where the host holds the GPU idle: sampled speculative steps left it ~0.35 ms a step idler than greedy
ones on the H200, and plain decoding did not).
Usage: python3 scripts/profile_eagle_kernels.py MODEL HEAD [TOKENS] ['D,M,C,N;...' draft trees, profiled too]"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from streamsd import LLM, SamplingParams

PROMPT = "Explain how a CPU cache hierarchy works, with an example of a cache miss."


def profile(llm: LLM, name: str, temperature: float, tokens: int) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=1)
    llm.generate(PROMPT, params)  # warm-up: graphs, compiles
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate(PROMPT, params)[0]
    wall = time.perf_counter() - t0
    st = out.spec_stats
    steps = st.steps if st is not None and st.steps else tokens
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate(PROMPT, params)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # name -> [ms, launches]
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # host CUDA API call -> [ms, calls]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            table, us = kernels, ev.self_device_time_total
        elif ev.name.startswith("cuda"):
            table, us = runtime, ev.self_cpu_time_total
        else:
            continue
        table[ev.name][0] += us / 1e3
        table[ev.name][1] += 1
    gpu_ms = sum(t[0] for t in kernels.values())
    print(f"\n=== {name} T={temperature:g}: {len(out.outputs[0].token_ids)} tokens in {steps} steps, "
          f"wall {1e3 * wall / steps:.3f} ms/step, GPU {gpu_ms / steps:.3f} ms/step (profiled pass)")
    _print_per_step(kernels, steps, 28, "launches")
    print("  host CUDA runtime calls:")
    _print_per_step(runtime, steps, 10, "calls")


def _print_per_step(table: dict[str, list[float]], steps: int, rows: int, unit: str) -> None:
    for what, (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"  {ms / steps * 1e3:8.1f} us/step  {n / steps:6.1f} {unit}/step  {what[:90]}")


def main() -> None:
    model, head = sys.argv[1], sys.argv[2]
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    trees = [t for t in sys.argv[4].split(";") if t] if len(sys.argv) > 4 else []
    common = dict(device="cuda", dtype="bfloat16", max_num_seqs=8)  # few graphs to capture
    plain = LLM(model, **common)
    for t in (0.0, 1.0):
        profile(plain, "plain", t, tokens)
    del plain
    for shape in trees:
        tree = LLM(model, draft_model=head, speculative_method="eagle", speculative_tree=shape, **common)
        for t in (0.0, 1.0):
            profile(tree, f"tree {shape}", t, tokens)
        del tree
    eagle = LLM(model, draft_model=head, speculative_method="eagle", speculation_policy="fixed",
                num_speculative_tokens=4, **common)
    for t in (0.0, 1.0):
        profile(eagle, "eagle k=4", t, tokens)


if __name__ == "__main__":
    main()
