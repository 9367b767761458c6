"""Training an EAGLE head: training-time test over unrolled draft steps, soft labels from the target.

At step 0 every head slot t reads the target's own streams h_t and the token at t + 1. At step j
the slot reads the head's own output of step j - 1 at t - 1, exactly as when it drafts, and
attends to the target-fed slots up to its anchor t - j plus its own earlier draft slots (the
"diagonal" keys), so training sees what inference sees. Every step predicts the token at t + 2
against the target's full distribution there (soft cross-entropy over the draft vocabulary); the
losses of later steps weigh less (decay^j).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamsd.model.llama import Transformer
from streamsd.spec.eagle_data import Sample
from streamsd.spec.eagle_head import EagleHead


@dataclass(frozen=True, slots=True)
class TrainConfig:
    epochs: float = 2.0
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of the steps
    weight_decay: float = 0.0
    ttt_steps: int = 4
    decay: float = 0.8
    batch_tokens: int = 2048
    grad_clip: float = 0.5
    time_budget_s: float | None = None  # fewer steps if the epochs would not fit (the schedule follows)
    seed: int = 0


@dataclass(slots=True)
class Batch:
    ids: torch.Tensor  # [B, T] int64, padded with 0
    streams: torch.Tensor  # [B, T, n * Ht] float32
    final: torch.Tensor  # [B, T, Ht] float32
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]


def make_batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Groups of samples of similar length (little padding), in random order."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    groups, cur, longest = [], [], 0
    for i in order:
        n = len(samples[i].ids)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(samples: list[Sample], device: torch.device) -> Batch:
    t = max(len(s.ids) for s in samples)
    b = len(samples)
    n_in, ht = samples[0].streams.shape[-1], samples[0].final.shape[-1]  # type: ignore[union-attr]
    ids = torch.zeros(b, t, dtype=torch.int64)
    streams = torch.zeros(b, t, n_in)
    final = torch.zeros(b, t, ht)
    for i, s in enumerate(samples):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        streams[i, : len(s.ids)] = s.streams.float()  # type: ignore[union-attr]
        final[i, : len(s.ids)] = s.final.float()  # type: ignore[union-attr]
    return Batch(ids.to(device), streams.to(device), final.to(device),
                 torch.tensor([len(s.ids) for s in samples], device=device),
                 torch.tensor([s.prompt_len for s in samples], device=device))


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], j: int, scale: float) -> torch.Tensor:
    """q [B, T, H, D]; ks/vs: steps 0..j, each [B, T, KVH, D] -> [B, T, H, D]."""
    b, t, h, d = q.shape
    rep = h // ks[0].shape[2]
    qh = q.transpose(1, 2)  # [B, H, T, D]

    def heads(x: torch.Tensor, shift: int) -> torch.Tensor:  # row p of the result is row p - shift of x
        return torch.roll(x, shift, dims=1).repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, H, T, D]

    pos = torch.arange(t, device=q.device)
    # Rows with no real anchor (p < j) still see key 0 so softmax stays finite; they carry no loss.
    mask = pos.unsqueeze(0) <= (pos - j).clamp(min=0).unsqueeze(1)  # [T, T]
    scores = [(qh @ heads(ks[0], 0).transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))]  # [B, H, T, T]
    diag_v = []
    for i in range(1, j + 1):  # the slot step i wrote at anchor + i
        scores.append((qh * heads(ks[i], j - i)).sum(-1, keepdim=True) * scale)  # [B, H, T, 1]
        diag_v.append(heads(vs[i], j - i))
    w = torch.softmax(torch.cat(scores, dim=-1), dim=-1)  # [B, H, T, T + j]
    out = w[..., :t] @ heads(vs[0], 0)  # [B, H, T, D]
    for i, v in enumerate(diag_v):
        out = out + w[..., t + i : t + i + 1] * v
    return out.transpose(1, 2)  # [B, T, H, D]


def ttt_outputs(head: EagleHead, ids: torch.Tensor, streams: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """ids [B, T], streams [B, T, n * Ht] -> per step j the head's pre-norm output [B, T, H]; row p of
    step j is what drafting computes at slot p when the target's states end at p - j."""
    b, t = ids.shape
    a = head.spec.args
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1).reshape(-1)  # [B*T] token t + 1
    positions = torch.arange(t, device=ids.device).repeat(b)  # [B*T]
    feats = head.features(streams.reshape(b * t, -1))  # [B*T, H]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs = []
    for j in range(steps):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, j: int = j) -> torch.Tensor:
            ks.append(k.view(b, t, a.num_kv_heads, a.head_dim))
            vs.append(v.view(b, t, a.num_kv_heads, a.head_dim))
            out = ttt_attention(q.view(b, t, a.num_heads, a.head_dim), ks, vs, j, a.head_dim**-0.5)
            return out.reshape(b * t, a.num_heads, a.head_dim)

        out = head.run_layer(nxt, feats, positions, attend).view(b, t, -1)  # [B, T, H]
        outs.append(out)
        # Step j + 1 at slot p reads this step's output at p - 1, as drafting does.
        feats = torch.cat([out[:, :1], out[:, :-1]], dim=1).reshape(b * t, -1)
    return outs


def ttt_loss(head: EagleHead, target: Transformer, batch: Batch, draft_ids: torch.Tensor, steps: int,
             decay: float) -> tuple[torch.Tensor, list[float], list[float]]:
    """Weighted soft cross-entropy over `steps` unrolled draft steps; also loss and top-1 match per step."""
    ids, (b, t) = batch.ids, batch.ids.shape
    with torch.no_grad():
        w_d = target.lm_head.weight.index_select(0, draft_ids).float()  # [Vd, Ht]
        label_logits = target.model.norm(batch.final) @ w_d.T  # [B, T, Vd] the target's next-token logits
        labels = torch.softmax(label_logits[:, 1:], dim=-1)  # [B, T-1, Vd]: row p -> the token at p + 2
        label_top = labels.argmax(-1)  # [B, T-1]
    pos = torch.arange(t - 1, device=ids.device).unsqueeze(0)  # [1, T-1]
    base_valid = (pos <= batch.lengths.unsqueeze(1) - 2) & (pos >= batch.prompt_lens.unsqueeze(1) - 1)  # [B, T-1]
    total = torch.zeros((), device=ids.device)
    norm = 0.0
    losses, matches = [], []
    for j, out in enumerate(ttt_outputs(head, ids, batch.streams, steps)):
        logp = F.log_softmax(head.draft_logits(out.reshape(b * t, -1)).view(b, t, -1)[:, :-1], dim=-1)  # [B, T-1, Vd]
        valid = (base_valid & (pos >= j)).float()  # [B, T-1]
        count = valid.sum().clamp(min=1.0)
        ce = -(labels * logp).sum(-1)  # [B, T-1]
        loss_j = (ce * valid).sum() / count
        total = total + decay**j * loss_j
        norm += decay**j
        losses.append(loss_j.item())
        matches.append((((logp.argmax(-1) == label_top).float() * valid).sum() / count).item())
    return total / norm, losses, matches


def train(head: EagleHead, target: Transformer, samples: list[Sample], draft_ids: list[int], cfg: TrainConfig,
          progress_factory=None) -> list[dict[str, float]]:
    """AdamW with linear warm-up and cosine decay; returns one record per optimiser step."""
    device = target.rope_cos.device
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    target.requires_grad_(False)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = len(make_batches(samples, cfg.batch_tokens, rng))
    total_steps = max(1, math.ceil(cfg.epochs * per_epoch))
    plan = {"total": total_steps, "warm": max(1, int(cfg.warmup * total_steps))}

    def lr_factor(s: int) -> float:  # linear warm-up, cosine decay to 10%
        done = min(1.0, max(0, s - plan["warm"]) / max(1, plan["total"] - plan["warm"]))
        return min((s + 1) / plan["warm"], 0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    d_ids = torch.tensor(draft_ids, dtype=torch.int64, device=device)
    history: list[dict[str, float]] = []
    bar = progress_factory(total_steps) if progress_factory else None
    t0, step = time.monotonic(), 0
    while step < plan["total"]:
        for group in make_batches(samples, cfg.batch_tokens, rng):
            if step >= plan["total"]:
                break
            batch = collate([samples[i] for i in group], device)
            loss, losses, matches = ttt_loss(head, target, batch, d_ids, cfg.ttt_steps, cfg.decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            if cfg.time_budget_s and step == 5:  # now the cost of a step is known: fit the budget
                fit = int(cfg.time_budget_s / ((time.monotonic() - t0) / step))
                plan["total"] = max(step + 1, min(plan["total"], fit))
                plan["warm"] = min(plan["warm"], max(1, int(cfg.warmup * plan["total"])))
                if bar is not None:
                    bar.total = plan["total"]
            rec = {"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0],
                   **{f"loss_{j}": x for j, x in enumerate(losses)}, **{f"match_{j}": x for j, x in enumerate(matches)}}
            history.append(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", match0=f"{matches[0]:.2f}", refresh=False)
                bar.update(1)
    if bar is not None:
        bar.close()
    head.eval()
    return history
