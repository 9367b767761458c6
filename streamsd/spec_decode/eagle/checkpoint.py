"""EAGLE head checkpoints: an HF directory (config.json + model.safetensors) in the community's layout.

EAGLE-3: `fc.*`, `midlayer.*`, `norm.*`, optional `lm_head.*`, `d2t`, `t2d`; EAGLE-1: `fc.*`,
`layers.0.*`. The config is a Llama config with `num_hidden_layers: 1`, `draft_vocab_size`,
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`. A head that does not fit
its target (hidden size, vocabulary, layer ids, weight shapes) is refused with a ModelLoadError.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from streamsd.model.arch import ModelArgs
from streamsd.model.llama import Transformer
from streamsd.model.loader import ModelLoadError, load_state_dict
from streamsd.spec_decode.eagle.borrowed import whole_vocab
from streamsd.spec_decode.eagle.head import (
    EAGLE1,
    EAGLE3,
    EagleHead,
    HeadSpec,
    default_aux_layers,
    head_config,
)

SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "eagle"


def head_dir(spec: str | None, model: str) -> Path:
    """The head to load: the one given, else the head shipped for `model`."""
    if spec:
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec} is not an EAGLE head directory (config.json + model.safetensors)")
        return path
    shipped = SHIPPED / Path(model).name
    if Path(model).name == model and (shipped / "config.json").is_file():  # a model name, not a path
        return shipped
    raise ModelLoadError(f"no EAGLE head is shipped for {model}; pass one with --draft-model DIR "
                         "(train it with `streamsd train-draft`)")


def save_head(head: EagleHead, out_dir: Path, target_config: dict[str, Any],
              dtype: torch.dtype = torch.bfloat16) -> Path:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = head_config(head.spec, target_config)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def new_head(target: Transformer, *, kind: str = EAGLE3, draft_ids: list[int] | None = None,
             aux_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None,
             norm_before_residual: bool = False) -> EagleHead:
    """A fresh head for `target` (float32, on its device). EAGLE-3 with `draft_ids`: its own lm_head
    over them, rows starting as the target's; without: it drafts through the target's lm_head (frozen,
    not saved: a head of a few MiB for any vocabulary size). Its norm starts as the target's.
    `norm_before_residual`: the decoder layer's residual starts from the normalised fused states
    (vLLM's config flag of the same name), not from `fc`'s raw output."""
    t = target.args
    args = dataclasses.replace(t, num_layers=1, intermediate_size=intermediate_size or t.intermediate_size)
    aux = (aux_layers or default_aux_layers(t.num_layers)) if kind == EAGLE3 else (t.num_layers,)
    ids = sorted(set(draft_ids)) if draft_ids is not None else list(range(t.vocab_size))
    spec = HeadSpec(kind, args, t.vocab_size, len(ids), t.hidden_size, tuple(aux),
                    norm_before_residual=norm_before_residual and kind == EAGLE3)
    dev = target.rope_cos.device
    own = kind == EAGLE3 and draft_ids is not None
    head = EagleHead(spec, own_lm_head=own, own_embed=False).to(dev).float()
    with torch.no_grad():
        if kind == EAGLE3:
            index = torch.tensor(ids, dtype=torch.int64, device=dev)
            if own:
                head.lm_head.weight.copy_(target.lm_head.weight.index_select(0, index).float())
            head.norm.weight.copy_(target.model.norm.weight.float())
            head.d2t.copy_(index - torch.arange(len(ids), device=dev))
            head.t2d.zero_().index_fill_(0, index, True)
    return head.attach(target)


def measured_depth_steps(path: Path) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """The depth steps (streamsd.policy.adaptive.acceptance) of the conditional acceptance that the head's
    ``eval_report.json`` measured at a fixed k: ("greedy", from its T = 0 run) and ("sampled", from
    the others); none without a report."""
    from streamsd.policy.adaptive.acceptance import depth_steps_of

    try:
        results = json.loads((Path(path) / "eval_report.json").read_text())["results"]
        curves = {float(t.removeprefix("T=")): [float(a) for a in r["conditional_acceptance"]]
                  for t, r in results.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()  # a head trained elsewhere: the estimator reads every depth alike
    classes = (("greedy", [c for t, c in curves.items() if t == 0.0]),
               ("sampled", [c for t, c in curves.items() if t > 0.0]))
    return tuple((name, depth_steps_of(found)) for name, found in classes if found)


def load_head(path: Path, target: Transformer, device: torch.device, dtype: torch.dtype,
              target_dir: Path | None = None) -> EagleHead:
    """The head in `path`, attached to `target`. Where `target` holds a tensor-parallel shard, the head
    reads whole copies of the target's embedding and lm_head it uses from `target_dir`, the target's
    weights (spec_decode/eagle/borrowed.py)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the EAGLE head config {path / 'config.json'}: {exc}") from exc
    state = load_state_dict(path, dtype=dtype, device=device)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    kind = EAGLE3 if any(k.startswith("midlayer.") for k in state) else (
        EAGLE1 if any(k.startswith("layers.0.") for k in state) else None)
    if kind is None or "fc.weight" not in state:
        raise ModelLoadError(f"{path} is not an EAGLE head: expected fc.* with midlayer.* (EAGLE-3) or "
                             "layers.0.* (EAGLE-1) weights")
    if kind == EAGLE1:  # layer 0 runs without an input norm; some exports still carry one
        state.pop("layers.0.input_layernorm.weight", None)
    spec = _fit(path, raw, ModelArgs.from_config({**raw, "model_type": "llama"}), target.args, state, kind)
    head = EagleHead(spec, own_lm_head="lm_head.weight" in state, own_embed="embed_tokens.weight" in state)
    if kind == EAGLE3:
        if "d2t" not in state:
            state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.int64, device=device)
        state["d2t"] = state["d2t"].to(torch.int64)
        ids = torch.arange(spec.draft_vocab_size, device=device) + state["d2t"]
        state["t2d"] = torch.zeros(spec.vocab_size, dtype=torch.bool, device=device).index_fill_(0, ids, True)
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"the weights of the EAGLE head in {path} do not fit its config.json: {exc}") from exc
    head.requires_grad_(False)
    shared = None
    if target.tp is not None:
        if target_dir is None:
            raise ValueError("an EAGLE head of a tensor-parallel target needs the target's weights (target_dir)")
        shared = whole_vocab(target_dir, target, embed=not head.own_embed, lm_head=not head.own_lm_head)
    return head.to(device).attach(target, shared).eval()


def _fit(path: Path, raw: dict[str, Any], args: ModelArgs, t: ModelArgs, state: dict[str, torch.Tensor],
         kind: str) -> HeadSpec:
    """The head's spec, once it is known to fit the target; else a ModelLoadError saying why."""
    def refuse(why: str) -> ModelLoadError:
        return ModelLoadError(f"the EAGLE head in {path} does not fit the target model: {why}")

    vocab = raw.get("vocab_size") or t.vocab_size
    if vocab != t.vocab_size:
        raise refuse(f"it drafts over a vocabulary of {vocab} tokens, the target has {t.vocab_size}")
    target_hidden = raw.get("target_hidden_size") or args.hidden_size
    if target_hidden != t.hidden_size:
        raise refuse(f"it reads hidden states of size {target_hidden}, the target's are {t.hidden_size}")
    shared_ok = args.hidden_size == t.hidden_size
    if "embed_tokens.weight" not in state and not shared_ok:
        raise refuse(f"its hidden size {args.hidden_size} differs from the target's and it ships no embed_tokens")
    fc_in = state["fc.weight"].shape[1]
    if kind == EAGLE1:
        if fc_in != 2 * args.hidden_size or not shared_ok:
            raise refuse(f"an EAGLE-1 head needs fc over 2 x {t.hidden_size} inputs, this one has {fc_in}")
        return HeadSpec(kind, args, vocab, vocab, target_hidden, (t.num_layers,), "fc.bias" in state)
    eagle_cfg = raw.get("eagle_config") or {}
    layers = tuple(eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(t.num_layers))
    if any(not 0 <= i <= t.num_layers for i in layers):
        raise refuse(f"it reads layers {list(layers)}, the target has only {t.num_layers}")
    if fc_in != len(layers) * target_hidden:
        raise refuse(f"fc takes {fc_in} inputs, but {len(layers)} layers of size {target_hidden} give "
                     f"{len(layers) * target_hidden}")
    draft_vocab = raw.get("draft_vocab_size") or vocab
    if "lm_head.weight" in state:
        rows = state["lm_head.weight"].shape[0]
        if rows != draft_vocab:
            raise refuse(f"lm_head has {rows} rows, draft_vocab_size says {draft_vocab}")
        if draft_vocab != vocab and "d2t" not in state:
            raise refuse("its draft vocabulary has no d2t map to the target's ids")
        if "d2t" in state:
            ids = torch.arange(draft_vocab, device=state["d2t"].device) + state["d2t"].to(torch.int64)
            if state["d2t"].numel() != draft_vocab or ids.min() < 0 or ids.max() >= vocab:
                raise refuse(f"its d2t map points outside the target's vocabulary of {vocab} tokens")
    elif not shared_ok:
        raise refuse("it has no lm_head and cannot share the target's (different hidden size)")
    elif draft_vocab != vocab:
        raise refuse("it names a draft vocabulary but ships no lm_head for it")
    return HeadSpec(kind, args, vocab, draft_vocab, target_hidden, layers, "fc.bias" in state,
                    bool(raw.get("norm_before_residual", False)))
