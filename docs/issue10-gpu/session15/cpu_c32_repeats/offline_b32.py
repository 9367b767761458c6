import json, time, sys
from streamsd import LLM, SamplingParams
prompts = [json.loads(l) for l in open('/work/shared/data/mt_bench_questions.jsonl')][:32]
def text(p):
    t = p.get('turns') or p.get('prompt') or p
    return t[0] if isinstance(t, list) else t
convs = [[{"role": "user", "content": text(p)}] for p in prompts]
llm = LLM("smollm2-135m-instruct", speculative_method="ngram", speculation_policy="adaptive")
tok = llm.tokenizer
for rep in range(2):
    for spec in (0, 4):
        sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.chat(convs, [sp] * 32) if spec else llm.chat(convs, [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, speculative=False)] * 32)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        pol = llm.core.rt.policy
        s = pol.summary()
        print(f"rep {rep} spec {spec}: {n/dt:.1f} tok/s  plain share {s['plain_step_share']:.3f} k {s['chosen_k']} probes {pol.planner.probe_steps} extra {pol.planner.probe_extra:.2f}", flush=True)
