"""Where a step leaves the GPU idle: the gaps between consecutive kernels on the device timeline,
plain decoding against a draft tree (batch 1, CUDA graphs, the real model and head, T = 0). Per engine:
kernels and idle microseconds per step, the idle split into gaps inside a replay and gaps of 20 us or
more (between replays, or the host late), and the kernel pairs whose gaps add up to most. Under the
CUDA profiler (it adds some time to each gap: compare the engines, not the absolute figures).
Usage: python3 scripts/profile_gaps.py MODEL HEAD [TOKENS] [TREE, e.g. 4,6,6,24]"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from streamsd import LLM, SamplingParams

PROMPT = "Explain how a CPU cache hierarchy works, with an example of a cache miss."
LONG_GAP_US = 20.0


def gaps(llm: LLM, name: str, tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, seed=1)
    llm.generate(PROMPT, params)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = llm.generate(PROMPT, params)[0]
        torch.cuda.synchronize()
    st = out.spec_stats
    steps = st.steps if st is not None and st.steps else tokens
    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: x[0])
    busy = sum(b - a for a, b, _ in evs)
    short, long_, pairs = 0.0, 0.0, defaultdict(lambda: [0.0, 0])
    for (_, end, prev), (start, _, nxt) in zip(evs, evs[1:], strict=False):
        gap = max(start - end, 0.0)
        if gap >= LONG_GAP_US:
            long_ += gap
            continue
        short += gap
        key = f"{prev[:38]} -> {nxt[:38]}"
        pairs[key][0] += gap
        pairs[key][1] += 1
    print(f"\n=== {name}: {steps} steps, {len(evs) / steps:.1f} kernels/step, busy {busy / steps:.1f} us/step, "
          f"gaps < {LONG_GAP_US:g} us {short / steps:.1f} us/step ({short / max(len(evs), 1):.2f} us each), "
          f"longer gaps {long_ / steps:.1f} us/step")
    for key, (us, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:22]:
        print(f"  {us / steps:7.1f} us/step  {n / steps:5.1f}/step  {us / n:5.2f} us each  {key}")


def main() -> None:
    model, head = sys.argv[1], sys.argv[2]
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    shape = sys.argv[4] if len(sys.argv) > 4 else "4,6,6,24"
    common = dict(device="cuda", dtype="bfloat16", max_num_seqs=8)
    plain = LLM(model, **common)
    gaps(plain, "plain", tokens)
    del plain
    tree = LLM(model, draft_model=head, speculative_method="eagle", speculative_tree=shape, **common)
    gaps(tree, f"tree {shape}", tokens)


if __name__ == "__main__":
    main()
