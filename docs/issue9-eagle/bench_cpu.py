"""Batch-1 decode speed of the default model on the CPU: plain vs n-gram vs EAGLE vs HF transformers.

Methods run round-robin per prompt so a shared, noisy machine slows them alike. tokens/s =
generated tokens / wall time of the request (prefill included), summed over the prompts.
Usage: python bench_cpu.py [--held-out training.json] [--prompts N] [--max-tokens N] [--threads N]
       [--temperatures 0,1] [--ignore-eos] [--dtype float32|bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", default="/work/shared/data/mt_bench_questions.jsonl")
    p.add_argument("--held-out", default=None, help="training.json whose held-out prompts to use")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="ours and HF alike (bfloat16: where the CPU has native bf16 matmuls)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from streamsd import LLM, SamplingParams
    from streamsd.model.loader import resolve_model

    if a.held_out:
        prompts = json.load(open(a.held_out))["held_out"][: a.prompts]
    else:
        prompts = [json.loads(line)["turns"][0] for line in open(a.questions)][: a.prompts]
    engines = {m: LLM(a.model, speculative_method=None if m == "plain" else m, device="cpu", max_num_seqs=4,
                      kv_cache_tokens=4096, dtype=a.dtype) for m in ("plain", "ngram", "eagle")}
    path = resolve_model(a.model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).eval()
    tok = engines["plain"].tokenizer
    rows = []
    for temp in (float(x) for x in a.temperatures.split(",")):
        totals = {m: [0, 0.0, 0, 0] for m in (*engines, "hf")}  # tokens, seconds, steps, emitted
        for i, prompt in enumerate(prompts):
            conv = [{"role": "user", "content": prompt}]
            for m, llm in engines.items():
                sp = SamplingParams(temperature=temp, max_tokens=a.max_tokens, seed=i, ignore_eos=a.ignore_eos)
                t0 = time.perf_counter()
                r = llm.chat(conv, sp)[0]
                totals[m][0] += len(r.outputs[0].token_ids)
                totals[m][1] += time.perf_counter() - t0
                totals[m][2] += r.spec_stats.steps
                totals[m][3] += r.spec_stats.emitted
            ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            t0 = time.perf_counter()
            with torch.no_grad():
                kw = dict(do_sample=True, temperature=temp) if temp > 0 else dict(do_sample=False)
                if a.ignore_eos:
                    kw["min_new_tokens"] = a.max_tokens
                gen = hf.generate(**ids, max_new_tokens=a.max_tokens, pad_token_id=tok.eos_token_id, **kw)
            totals["hf"][0] += gen.shape[1] - ids["input_ids"].shape[1]
            totals["hf"][1] += time.perf_counter() - t0
        base = totals["plain"][0] / totals["plain"][1]
        for m, (n, s, steps, emitted) in totals.items():
            rows.append({"method": m, "temperature": temp, "tokens": n, "seconds": round(s, 2),
                         "tokens_per_s": round(n / s, 2), "vs_plain": round(n / s / base, 2),
                         "tau": round(emitted / steps, 3) if steps else None})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        json.dump({"threads": a.threads, "dtype": a.dtype, "prompts": len(prompts), "max_tokens": a.max_tokens,
                   "ignore_eos": a.ignore_eos, "rows": rows},
                  open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
