"""The draft-vocabulary experiment (issue 9, session 25): would the shipped head draft as well over
only the default model's frequent answer ids, its lm_head cut to the target's rows of them?

  python3 scripts/draft_vocab.py freq OUT.json [--prompts N]   the model's own answers (CPU, batch 64, 128
                                tokens, T = 0 / 0.7 / 1 in turn) to N of its training prompts: id counts
  python3 scripts/draft_vocab.py prune FREQ.json V OUT_DIR      the shipped head with an lm_head of the V most
                                frequent ids (the lowest unseen ids fill in) and its d2t map: a head directory
                                for bench_eagle.py --head

Training prompts only (scripts/eagle_variants.py prompts writes them to /tmp/prompts.jsonl); the
held-out ones stay out of the counts."""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HEAD = Path("streamsd/assets/eagle/smollm2-135m-instruct")


def freq(out: str, n: int, prompts_file: str) -> None:
    from streamsd import LLM, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in open(prompts_file)]
    random.Random(0).shuffle(prompts)
    llm = LLM("smollm2-135m-instruct", device="cpu", max_num_seqs=64, kv_cache_tokens=64 * 640)
    counts: collections.Counter[int] = collections.Counter()
    for i in range(0, n, 64):
        batch = [[{"role": "user", "content": p}] for p in prompts[i : min(i + 64, n)]]
        params = [SamplingParams(temperature=(0.0, 0.7, 1.0)[j % 3], max_tokens=128, seed=j) for j in range(len(batch))]
        for r in llm.chat(batch, params):
            counts.update(r.outputs[0].token_ids)
        print(min(i + 64, n), "prompts,", sum(counts.values()), "tokens", flush=True)
    json.dump({"tokens": sum(counts.values()), "counts": counts.most_common()}, open(out, "w"))


def prune(freq_file: str, v: int, out: Path) -> None:
    from streamsd.model.loader import resolve_model

    target = load_file(str(Path(resolve_model("smollm2-135m-instruct", progress=False)) / "model.safetensors"))
    lm = target.get("lm_head.weight", target["model.embed_tokens.weight"])  # [V, H] (tied embeddings)
    counts = json.load(open(freq_file))["counts"]
    seen = {int(t) for t, _ in counts[:v]}
    ids = sorted(seen | set([i for i in range(lm.shape[0]) if i not in seen][: v - len(seen)]))  # ascending, as d2t wants
    index = torch.tensor(ids)
    state = load_file(str(HEAD / "model.safetensors"))
    state["lm_head.weight"] = lm.index_select(0, index).to(state["fc.weight"].dtype).contiguous()  # [V', H]
    state["d2t"] = index - torch.arange(v)
    state["t2d"] = torch.zeros(lm.shape[0], dtype=torch.bool).index_fill_(0, index, True)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    cfg = json.load(open(HEAD / "config.json"))
    cfg["draft_vocab_size"] = v
    json.dump(cfg, open(out / "config.json", "w"), indent=1)
    for f in ("training.json", "eval_report.json"):
        shutil.copy(HEAD / f, out / f)
    print(f"V' = {v}: {len(seen)} ids seen in the answers, the rest the lowest unseen -> {out}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("freq")
    f.add_argument("out")
    f.add_argument("--prompts", type=int, default=384)
    f.add_argument("--prompts-file", default="/tmp/prompts.jsonl")
    q = sub.add_parser("prune")
    q.add_argument("freq")
    q.add_argument("v", type=int)
    q.add_argument("out", type=Path)
    a = p.parse_args()
    if a.cmd == "freq":
        freq(a.out, a.prompts, a.prompts_file)
    else:
        prune(a.freq, a.v, a.out)


if __name__ == "__main__":
    main()
