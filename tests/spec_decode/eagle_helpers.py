"""What the EAGLE tests share: the tiny target and its config, a head trained on its answers, and an eagle
engine whose propose calls run the graph bodies eagerly on the CPU (the chained path, as on CUDA)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from streamsd import LLM, SamplingParams
from streamsd.model.loader import load_model
from streamsd.spec_decode.eagle.checkpoint import new_head, save_head
from streamsd.train.data import Sample, attach_streams
from streamsd.train.loop import TrainConfig, train
from tests.engine.engine_helpers import PROMPTS
from tests.tiny import CORPUS

CPU = torch.device("cpu")


def tiny_target(model_dir):
    return load_model(str(model_dir), CPU, torch.float32)[0]


def tiny_config(model_dir) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def train_tiny_head(model_dir, out: Path, kind: str, epochs: float = 30) -> Path:
    """A head that has seen the target's continuations of the test prompts: some drafts pass, some fail.
    "eagle3_norm_first": an EAGLE-3 head whose residual starts from the normalised fused states (the
    shipped head's layout)."""
    torch.manual_seed(0)  # the same head whichever tests ran before
    llm = LLM(str(model_dir))
    prompts = PROMPTS + CORPUS[:6]
    params = [SamplingParams(temperature=t, max_tokens=32, seed=i, ignore_eos=True)
              for i, t in enumerate([0.0] * len(prompts) + [1.0] * len(prompts))]
    res = llm.generate(prompts * 2, params)
    samples = [Sample(r.prompt_token_ids + r.outputs[0].token_ids, len(r.prompt_token_ids)) for r in res]
    target = llm.core.rt.worker.target
    norm_first = kind == "eagle3_norm_first"
    kind = "eagle3" if norm_first else kind
    draft_ids = sorted({t for s in samples for t in s.ids} | {0, 1, 2}) if kind == "eagle3" else None
    head = new_head(target, kind=kind, draft_ids=draft_ids, norm_before_residual=norm_first)
    attach_streams(target, samples, head.input_layers)
    train(head, target, samples, draft_ids or list(range(target.args.vocab_size)),
          TrainConfig(epochs=epochs, lr=1e-2, batch_tokens=1024))
    return save_head(head, out, tiny_config(model_dir), torch.float32)


def tensor_layout(layout):
    """A graph's layout (its host lists are placeholders) with host lists read from its tensors, so the
    CPU reference attention can run what the graph body computes."""
    from streamsd.model.kv_cache import BatchLayout

    ctx, qs = layout.context_lens_t.tolist(), layout.query_starts_t.tolist()
    lens = [b - a for a, b in zip(qs, qs[1:], strict=False)]
    tables = [row[: -(-c // 16)] if c else [] for row, c in zip(layout.block_table.tolist(), ctx, strict=False)]
    return BatchLayout(layout.positions, layout.slot_mapping, qs[:-1], lens, ctx, tables, layout.block_table,
                       layout.context_lens_t, layout.query_starts_t)


def chained_engine(model_dir, head_dir, k: int = 4, past_max_tokens: bool = False, **kwargs) -> LLM:
    """An eagle engine whose propose calls run the graph bodies eagerly on the CPU (no capture), so the
    worker's chained path (the head queued behind the verify) runs here as it does on CUDA.
    `past_max_tokens`: near max_tokens requests keep the batch's k, as where chained steps queue ahead
    (SchedulerConfig.drafts_past_max_tokens; pipeline=True sets it): a reference for such an engine."""
    from streamsd.spec_decode.eagle.graphs import EagleGraphs

    llm = LLM(str(model_dir), speculative_method="eagle", draft_model=str(head_dir), num_speculative_tokens=k, **kwargs)
    if past_max_tokens:
        sched = llm.core.scheduler
        sched.cfg = dataclasses.replace(sched.cfg, drafts_past_max_tokens=True)
    worker = llm.core.rt.worker
    proposer = worker.proposer

    def run_layer(ids, feats, layout):
        return proposer.head.run_layer(ids, feats, layout.positions, proposer._attend(tensor_layout(layout)))

    proposer.graphs = EagleGraphs(proposer.head, run_layer, worker.cache.block_size, worker.cache.data.shape[2] - 1,
                                  max_blocks=64, width=k + 1, stream_dtype=torch.float32, device=CPU,
                                  q_pool=proposer.q_pool)
    return llm
