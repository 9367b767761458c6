"""τ of an EAGLE head's chains and draft trees, simulated on the target's own answers (no timing).

For each held-out prompt the target answers (greedy, or sampled at --temperature with a seed); one
causal pass gives the target's streams at every position and one head pass its context K/V. Then,
step by step from the end of the prompt, each shape's tree is grown from the head's state at the
pending token (spec_decode/eagle/tree.py's algorithm, with dense masks), and the step accepts the longest
tree path matching the answer. That is the walk's outcome exactly: the walk samples the target at
each row, and following its own answer is one such sample (sample/tree_verify.py). τ = tokens per step.

At T > 0 the answer is plain decoding's seeded one, and `--rank` says how children are ranked:
`q` by the head's probabilities, `race` by the target's race at their position
(spec/eagle_tree.race_logits, as the engine does), `both` each shape both ways. `--draft-scale s`
races the head's logits times s (s < 1: flatter q).

Usage: python scripts/tree_tau.py [--prompts 8] [--skip 0] [--max-tokens 256] [--temperature 0]
         [--shapes '4,1,1,4;5,4,4,16;6,6,6,31'] [--rank race|q|both] [--draft-scale 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from streamsd import LLM, SamplingParams
from streamsd.config import TreeShape
from streamsd.model.kv_cache import BatchLayout, PagedKVCache
from streamsd.spec_decode.eagle.tree import Race, race_logits

HELD_OUT = "streamsd/assets/eagle/smollm2-135m-instruct/training.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--skip", type=int, default=0, help="held-out prompts to skip (to split a run)")
    p.add_argument("--rank", choices=("race", "q", "both"), default="race")
    p.add_argument("--draft-scale", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--shapes", default="4,1,1,4;6,1,1,6;5,4,4,16;6,6,6,31")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    shapes = [TreeShape.parse(s) for s in a.shapes.split(";")]
    prompts = json.load(open(HELD_OUT))["held_out"][a.skip : a.skip + a.prompts]
    llm = LLM(a.model, speculative_method="eagle", draft_model=a.head, device="cpu", dtype="float32",
              max_num_seqs=16, kv_cache_tokens=16384)
    plain = LLM(a.model, device="cpu", dtype="float32", max_num_seqs=16, kv_cache_tokens=16384)
    answers = plain.chat([[{"role": "user", "content": q}] for q in prompts],
                         SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=SEED))
    sim = Simulator(llm, a.temperature, a.draft_scale)
    ranks = ["q"] if a.temperature == 0 else ["race", "q"] if a.rank == "both" else [a.rank]
    runs = [(rank, s) for rank in ranks for s in shapes]
    totals = {f"{rank} {s}": [0, 0] for rank, s in runs}  # steps, tokens
    t0 = time.time()
    for res in answers:
        ids = res.prompt_token_ids + res.outputs[0].token_ids
        sim.load(ids)
        for rank, s in runs:
            sim.raced = rank == "race"
            pos = len(res.prompt_token_ids)  # the pending token: its stream is not known yet
            while pos < len(ids) - 1:
                accepted = sim.accepted(pos, s, ids[pos + 1 :])
                totals[f"{rank} {s}"][0] += 1
                totals[f"{rank} {s}"][1] += accepted + 1
                pos += accepted + 1
        print(f"{time.time() - t0:.0f}s", {k: round(t / n, 3) for k, (n, t) in totals.items()}, flush=True)
    tau = {k: round(t / n, 3) for k, (n, t) in totals.items()}
    print(f"\nT={a.temperature:g}, {len(prompts)} prompts x {a.max_tokens} tokens")
    print(f"{'rank, shape (D,M,C,N)':24} {'tau':>6}")
    for k, v in tau.items():
        print(f"{k:24} {v:>6}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"temperature": a.temperature, "prompts": len(prompts), "skip": a.skip, "max_tokens": a.max_tokens,
                       "draft_scale": a.draft_scale, "steps_tokens": totals, "tau": tau}, f, indent=2)


SEED = 7


class Simulator:
    def __init__(self, llm: LLM, temperature: float = 0.0, draft_scale: float = 1.0):
        worker = llm.core.rt.worker
        self.target, self.head = worker.target, worker.proposer.head
        self.scale = self.head.spec.args.head_dim ** -0.5
        self.temperature, self.draft_scale = temperature, draft_scale
        self.raced = False
        self.pos = 0

    def load(self, ids: list[int]) -> None:
        """The target's streams over the whole answer, and the head's K/V and outputs at every slot."""
        n = len(ids)
        blocks = -(-n // 16) + 1
        cache = PagedKVCache(self.target.args, blocks, 16, torch.float32, torch.device("cpu"))
        layout = BatchLayout.build([0], [n], [list(range(blocks))], 16, torch.device("cpu"))
        out = self.target(torch.tensor(ids), layout, cache, torch.arange(n), hidden_layers=self.head.input_layers,
                          hidden_rows=torch.arange(n))
        feats = self.head.features(torch.cat(out.hidden, dim=-1))
        causal = torch.ones(n - 1, n - 1, dtype=torch.bool).tril()
        self.out, self.k, self.v = self._layer(torch.tensor(ids[1:]), feats[: n - 1], torch.arange(n - 1), None,
                                               None, causal)

    def _layer(self, ids, feats, positions, keys, values, mask):
        """The head's layer over new rows that see `keys`/`values` and their own K/V where `mask` [rows,
        keys + rows] says."""
        captured = {}

        def attend(q, k, v):
            captured["k"], captured["v"] = k, v
            kk = k if keys is None else torch.cat([keys, k])
            vv = v if values is None else torch.cat([values, v])
            o = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                               attn_mask=mask, scale=self.scale, enable_gqa=True)
            return o.transpose(0, 1)

        out = self.head.run_layer(ids, feats, positions, attend)
        return out, captured["k"], captured["v"]

    def accepted(self, pos: int, s: TreeShape, answer: list[int]) -> int:
        """Grow shape s from the pending token at `pos` (context slots 0 .. pos - 1) -> the longest
        tree path matching `answer` (the tokens after it)."""
        keys, values = self.k[:pos], self.v[:pos]
        self.pos = pos
        nodes: list[tuple[int, int, float]] = []  # (token, parent node or -1, path log-probability)
        level = self._children(self.out[pos - 1 : pos], [-1], [0.0], s.branch, nodes, 1)
        feats = {i: self.out[pos - 1] for i in level}
        anc: dict[int, list[int]] = {i: [] for i in level}
        slot: dict[int, int] = {}  # expanded node -> its row among the tree keys
        tree_k = tree_v = None
        for depth in range(1, s.depth):
            frontier = sorted(level, key=lambda i: -nodes[i][2])[: s.frontier]
            ntree = 0 if tree_k is None else tree_k.shape[0]
            mask = torch.zeros(len(frontier), pos + ntree + len(frontier), dtype=torch.bool)
            mask[:, :pos] = True  # the context
            for r, i in enumerate(frontier):
                for up in anc[i]:
                    mask[r, pos + slot[up]] = True
                mask[r, pos + ntree + r] = True
            kk = keys if tree_k is None else torch.cat([keys, tree_k])
            vv = values if tree_v is None else torch.cat([values, tree_v])
            out, k, v = self._layer(torch.tensor([nodes[i][0] for i in frontier]),
                                    torch.stack([feats[i] for i in frontier]),
                                    torch.full((len(frontier),), pos - 1 + depth), kk, vv, mask)
            for r, i in enumerate(frontier):
                slot[i] = ntree + r
            tree_k = k if tree_k is None else torch.cat([tree_k, k])
            tree_v = v if tree_v is None else torch.cat([tree_v, v])
            level = self._children(out, frontier, [nodes[i][2] for i in frontier], s.branch, nodes, depth + 1)
            for j in level:
                up = nodes[j][1]
                anc[j] = anc[up] + [up]
                feats[j] = out[frontier.index(up)]
        kept = set(sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], i))[: s.nodes])
        cur, got = -1, 0
        while got < len(answer):
            nxt = [i for i in kept if nodes[i][1] == cur and nodes[i][0] == answer[got]]
            if not nxt:
                break
            cur, got = nxt[0], got + 1
        return got

    def _children(self, out, parents, scores, c, nodes, depth) -> list[int]:
        """Children at `depth`: the token at position pos + depth, decided by the noise keyed there."""
        logits = self.head.target_logits(out).float()
        if self.raced:
            race = Race(torch.tensor([0]), torch.tensor([SEED]), torch.tensor([self.temperature / self.draft_scale]))
            logits = race_logits(logits, race, torch.tensor([self.pos + depth]))
        logp = F.log_softmax(logits, dim=-1)
        top = logp.topk(c, dim=-1)
        new = []
        for r, up in enumerate(parents):
            for value, token in zip(top.values[r].tolist(), top.indices[r].tolist(), strict=True):
                nodes.append((token, up, scores[r] + value))
                new.append(len(nodes) - 1)
        return new


if __name__ == "__main__":
    main()
