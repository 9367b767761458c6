"""Training an EAGLE head: training-time test over unrolled draft steps, soft labels from the target.

At step 0 every head slot t reads the target's own streams h_t and the token at t + 1. At step j
the slot reads the head's own output of step j - 1 at t - 1, exactly as when it drafts, and
attends to the target-fed slots up to its anchor t - j plus its own earlier draft slots (the
"diagonal" keys), so training sees what inference sees. Every step predicts the token at t + 2
against the target's full distribution there (soft cross-entropy over the draft vocabulary); the
losses of later steps weigh less (decay^j).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from streamsd.model.kv_cache import h2d
from streamsd.model.llama import Transformer
from streamsd.spec_decode.eagle.head import EagleHead
from streamsd.train.data import Sample


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


@dataclass(slots=True)
class Corpus:
    """Every sample end to end on the training device, so a batch is one gather (no host copies).
    The last row of each tensor is the padding row: id 0, zero streams."""

    ids: torch.Tensor  # [N + 1] int64
    streams: torch.Tensor  # [N + 1, n * Ht] in the samples' dtype (bf16)
    final: torch.Tensor  # [N + 1, Ht]
    offsets: list[int]  # first row of each sample
    lengths: list[int]
    prompt_lens: list[int]

    @staticmethod
    def build(samples: list[Sample], device: torch.device, release: bool = False) -> Corpus:
        """With `release`, each sample's tensors are dropped once copied: memory peaks at one copy."""
        lengths = [len(s.ids) for s in samples]
        offsets = [0, *itertools.accumulate(lengths)]
        n, first = offsets[-1], samples[0]
        assert first.streams is not None and first.final is not None, "samples need their streams"
        streams = torch.zeros(n + 1, first.streams.shape[-1], dtype=first.streams.dtype, device=device)
        final = torch.zeros(n + 1, first.final.shape[-1], dtype=first.final.dtype, device=device)
        for s, o, length in zip(samples, offsets, lengths, strict=False):
            streams[o : o + length] = s.streams  # type: ignore[assignment]
            final[o : o + length] = s.final  # type: ignore[assignment]
            if release:
                s.streams = s.final = None
        ids = torch.tensor([t for s in samples for t in s.ids] + [0], dtype=torch.int64).to(device)
        return Corpus(ids, streams, final, offsets[:-1], lengths, [s.prompt_len for s in samples])

    def batch(self, group: list[int], device: torch.device) -> Batch:
        t = max(self.lengths[g] for g in group)
        pad = self.ids.shape[0] - 1
        index = np.full((len(group), t), pad, dtype=np.int64)  # [B, T] rows of the corpus
        for i, g in enumerate(group):
            index[i, : self.lengths[g]] = np.arange(self.offsets[g], self.offsets[g] + self.lengths[g])
        idx = h2d(torch.from_numpy(index), torch.int64, device)
        return Batch(self.ids[idx], self.streams[idx].float(), self.final[idx].float(),
                     h2d([self.lengths[g] for g in group], torch.int64, device),
                     h2d([self.prompt_lens[g] for g in group], torch.int64, device))


def make_batches(lengths: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Groups of samples of similar length (little padding), in random order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


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
             decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted soft cross-entropy over `steps` unrolled draft steps, and a detached [2 * steps]
    tensor of each step's loss then top-1 match (left on the device: reading it is a host sync)."""
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
        losses.append(loss_j.detach())
        matches.append(((logp.argmax(-1) == label_top).float() * valid).sum() / count)
    return total / norm, torch.stack(losses + matches)


def train(head: EagleHead, target: Transformer, samples: list[Sample], draft_ids: list[int], cfg: TrainConfig,
          log: Callable[[str], None] | None = None, release: bool = False) -> list[dict[str, float]]:
    """AdamW with linear warm-up and cosine decay; returns one record per optimiser step.

    The loop never waits for the GPU except where it logs (every ~10 s, and at step 5 to fit the
    time budget): the per-step figures stay on the device until then. With `release` the samples'
    tensors are dropped once the corpus holds them.
    """
    device = target.rope_cos.device
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    corpus = Corpus.build(samples, device, release)
    target.requires_grad_(False)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = len(make_batches(corpus.lengths, cfg.batch_tokens, rng))
    epoch_steps = max(1, math.ceil(cfg.epochs * per_epoch))
    plan = {"total": epoch_steps, "warm": max(1, int(cfg.warmup * epoch_steps))}

    def lr_factor(s: int) -> float:  # linear warm-up, cosine decay to 10%
        done = min(1.0, max(0, s - plan["warm"]) / max(1, plan["total"] - plan["warm"]))
        return min((s + 1) / plan["warm"], 0.1 + 0.45 * (1 + math.cos(math.pi * done)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    d_ids = torch.tensor(draft_ids, dtype=torch.int64, device=device)
    history: list[dict[str, float]] = []
    pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, [1 + 2 * ttt_steps] on the device)
    tokens = 0
    t0 = last_sync = time.monotonic()

    def flush() -> None:  # the one host read of the figures since the last flush
        if not pending:
            return
        values = torch.stack([v for _, _, v in pending]).tolist()
        k = cfg.ttt_steps
        for (step_no, lr, _), v in zip(pending, values, strict=True):
            history.append({"step": step_no, "loss": v[0], "lr": lr,
                            **{f"loss_{j}": v[1 + j] for j in range(k)},
                            **{f"match_{j}": v[1 + k + j] for j in range(k)}})
        pending.clear()

    def report() -> None:
        el = max(time.monotonic() - t0, 1e-9)
        assert log is not None  # called only where a log was given
        r = history[-1]
        matches = " / ".join(f"{r[f'match_{j}']:.2f}" for j in range(cfg.ttt_steps))
        log(f"training: step {r['step']}/{plan['total']} ({r['step'] / per_epoch:.2f} epochs), loss "
            f"{r['loss']:.3f}, top-1 match {matches}, lr {r['lr']:.2e}, {tokens / el:.0f} tokens/s, {el:.0f}s")

    step = 0
    while step < plan["total"]:
        for group in make_batches(corpus.lengths, cfg.batch_tokens, rng):
            if step >= plan["total"]:
                break
            batch = corpus.batch(group, device)
            loss, figures = ttt_loss(head, target, batch, d_ids, cfg.ttt_steps, cfg.decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            lr = sched.get_last_lr()[0]
            assert isinstance(lr, float)  # a group's lr keeps the type it was given: AdamW's float
            sched.step()
            step += 1
            tokens += sum(corpus.lengths[g] for g in group)
            pending.append((step, lr, torch.cat([loss.detach().view(1), figures])))
            periodic = step == 5 or time.monotonic() - last_sync > 10
            if periodic and (cfg.time_budget_s or log):
                flush()  # waits for the GPU: the time per step is now real, not launch time
                last_sync = time.monotonic()
                if cfg.time_budget_s:  # fit the schedule to the budget, both ways, at most the epochs
                    fit = int(cfg.time_budget_s / ((last_sync - t0) / step))
                    plan["total"] = max(step + 1, min(epoch_steps, fit))
                    plan["warm"] = min(plan["warm"], max(1, int(cfg.warmup * plan["total"])))
            if cfg.time_budget_s and time.monotonic() - t0 > cfg.time_budget_s:
                plan["total"] = step  # out of time: stop now (the schedule was fitted to end about here)
            if log and (periodic or step >= plan["total"]):
                flush()
                report()
    flush()
    if log and history and history[-1]["step"] != step:
        report()
    head.eval()
    return history


@torch.no_grad()
def validate(head: EagleHead, target: Transformer, samples: list[Sample], draft_ids: list[int],
             cfg: TrainConfig) -> dict[str, float]:
    """Loss and top-1 match per unrolled step on answers the head never trained on (weighted by
    tokens): the training batches' own figures measure memorisation as much as drafting."""
    if not samples:
        return {}
    device = target.rope_cos.device
    corpus = Corpus.build(samples, device, False)
    d_ids = torch.tensor(draft_ids, dtype=torch.int64, device=device)
    training = head.training
    head.eval()
    total: torch.Tensor | None = None  # [2 * ttt_steps]
    weight = 0
    for group in make_batches(corpus.lengths, cfg.batch_tokens, random.Random(cfg.seed)):
        n = sum(corpus.lengths[g] for g in group)
        _, figures = ttt_loss(head, target, corpus.batch(group, device), d_ids, cfg.ttt_steps, cfg.decay)
        total = figures * n if total is None else total + figures * n
        weight += n
    head.train(training)
    assert total is not None
    values = (total / weight).tolist()
    k = cfg.ttt_steps
    return {**{f"loss_{j}": values[j] for j in range(k)}, **{f"match_{j}": values[k + j] for j in range(k)}}

