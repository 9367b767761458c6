"""The c = 32 cell offline: 32 MT-Bench first turns at once, 48 tokens, speculation off then on, twice.

Usage: python docs/issue10-gpu/session15/cpu_c32_repeats/offline_b32.py"""

import json
import time

from streamsd import LLM, SamplingParams

with open("/work/shared/data/mt_bench_questions.jsonl") as f:
    questions = [json.loads(line) for line in f][:32]
convs = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
llm = LLM("smollm2-135m-instruct", speculative_method="ngram", speculation_policy="adaptive")
for rep in range(2):
    for speculative in (False, True):
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, speculative=speculative)
        t0 = time.perf_counter()
        outs = llm.chat(convs, [sp] * len(convs))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        s = llm.core.rt.policy.summary()
        print(f"rep {rep} speculation {'on' if speculative else 'off'}: {tokens / (time.perf_counter() - t0):.1f} tok/s, "
              f"plain share so far {s['plain_step_share']:.3f}, k {s['chosen_k']}", flush=True)
