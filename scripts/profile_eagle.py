"""Where an EAGLE step's time goes on the GPU, against a plain step, on a small random target with an
untrained head (launch and host costs do not depend on weights). Prints tokens/s of plain vs eagle,
the CPU-side hot spots of eagle steps (cProfile) and the CUDA profiler's table of host API calls
(synchronisations show up as cudaStreamSynchronize / cudaMemcpy).
Usage: python3 scripts/profile_eagle.py [OUT_DIR]"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from tiny_eagle import build_tiny_eagle

from streamsd import LLM, SamplingParams


def main() -> None:
    target_dir, head_dir = build_tiny_eagle()
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompt = "Speculative decoding proposes tokens with a cheap draft"
    rates = {}
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")  # the CPU only for a dry run
    llms = {"plain": LLM(str(target_dir), device=dev, dtype=dtype),
            "eagle": LLM(str(target_dir), speculative_method="eagle", draft_model=str(head_dir), device=dev,
                         dtype=dtype, speculation_policy="fixed")}
    for name, llm in llms.items():
        llm.generate(prompt, params)  # warm-up: graphs, Triton compiles
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        dt = time.perf_counter() - t0
        st = out.spec_stats
        rates[name] = len(out.outputs[0].token_ids) / dt
        print(f"{name}: {rates[name]:.0f} tok/s, {1e3 * dt / max(st.steps, 1) if st.steps else 1e3 * dt / 128:.2f}"
              f" ms/step, tau {st.emitted / st.steps if st.steps else 1:.2f}")
    llm = llms["eagle"]
    core = llm.core
    for temperature in (0.0, 1.0):
        print(f"\n=== cProfile of eagle steps at T={temperature:g}")
        core.add_request(f"profiled{temperature}", core.encode_prompt(prompt),
                         SamplingParams(temperature=temperature, max_tokens=128, ignore_eos=True, seed=1))
        prof = cProfile.Profile()
        prof.enable()
        while core.has_work:
            core.step()  # one thread: cProfile sees the worker's side too
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as p:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))


if __name__ == "__main__":
    main()
