"""EAGLE head checkpoints: layouts that round-trip, a head without a draft vocabulary, heads refused."""

from __future__ import annotations

import json

import pytest
import torch

from streamsd import LLM
from streamsd.model.loader import ModelLoadError
from streamsd.spec_decode.eagle.checkpoint import load_head, new_head, save_head
from streamsd.train.data import Sample, attach_streams
from streamsd.train.loop import ttt_outputs
from tests.engine.engine_helpers import PROMPTS, assert_free, greedy_params
from tests.spec_decode.eagle_helpers import CPU, tiny_config, tiny_target


@pytest.mark.parametrize("kind,norm_first", [("eagle3", False), ("eagle3", True), ("eagle1", False)])
def test_layouts_round_trip(tiny_model_dir, tmp_path, kind, norm_first):
    target = tiny_target(tiny_model_dir)
    head = new_head(target, kind=kind, draft_ids=list(range(0, 384, 2)) if kind == "eagle3" else None,
                    norm_before_residual=norm_first)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_head(head, tmp_path, tiny_config(tiny_model_dir), torch.float32)
    cfg = tiny_config(tmp_path)
    assert cfg["num_hidden_layers"] == 1 and cfg["target_hidden_size"] == 64 and cfg["vocab_size"] == 384
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    if kind == "eagle3":
        assert cfg["draft_vocab_size"] == 192 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
        assert cfg["norm_before_residual"] is norm_first
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
        assert any(n.startswith("midlayer.self_attn.") for n in names) and "midlayer.hidden_norm.weight" in names
    else:
        assert "fc.weight" in names and any(n.startswith("layers.0.self_attn.") for n in names)
        assert not any(n.startswith(("midlayer.", "lm_head", "norm.")) for n in names)
    loaded = load_head(tmp_path, target, CPU, torch.float32)
    assert loaded.spec.norm_before_residual is norm_first
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Same drafts from the same states: the training unroll and the paged proposer agree too.
    ids = torch.randint(3, 300, (1, 24))
    s = Sample(ids[0].tolist(), 4)
    attach_streams(target, [s], head.input_layers, dtype=torch.float32)
    with torch.no_grad():
        x, y = ttt_outputs(head, ids, s.streams[None], 2), ttt_outputs(loaded, ids, s.streams[None], 2)
        assert all(torch.allclose(p, q) for p, q in zip(x, y, strict=True))
        logits = loaded.target_logits(y[0][0])
    if kind == "eagle3":  # ids outside the draft vocabulary can never be drafted
        assert torch.isinf(logits[:, 1::2]).all() and torch.isfinite(logits[:, ::2]).all()


def test_eagle3_head_without_a_draft_vocabulary_drafts_through_the_targets_lm_head(tiny_model_dir, tmp_path,
                                                                                   reference):
    """`train-draft --draft-vocab-size 0`: no lm_head of its own (the file holds no vocabulary-sized
    matrix), the target's frozen one serves every id; it saves, loads and stays exact."""
    target = tiny_target(tiny_model_dir)
    head = new_head(target, kind="eagle3")
    assert not hasattr(head, "lm_head") and not head.has_draft_vocab
    save_head(head, tmp_path, tiny_config(tiny_model_dir), torch.float32)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not any(n.startswith("lm_head") for n in f.keys())
    assert tiny_config(tmp_path)["draft_vocab_size"] == 384
    loaded = load_head(tmp_path, target, CPU, torch.float32)
    assert loaded.draft_logits(torch.randn(2, 64)).shape == (2, 384)
    llm = LLM(str(tiny_model_dir), speculative_method="eagle", draft_model=str(tmp_path))
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy_params())] == reference
    assert_free(llm)


def test_mismatched_heads_are_refused(tiny_model_dir, tiny_draft_dir, heads, tmp_path):
    import shutil

    with pytest.raises(ModelLoadError, match="hidden states of size 64, the target's are 32"):
        LLM(str(tiny_draft_dir), speculative_method="eagle", draft_model=str(heads["eagle3"]))
    target = tiny_target(tiny_model_dir)
    for change, message in [({"vocab_size": 500}, "vocabulary of 500 tokens"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}}, "layers \\[0, 1, 9\\]"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}}, "fc takes 192 inputs")]:
        bad = tmp_path / message[:6].replace(" ", "_")
        shutil.copytree(heads["eagle3"], bad)
        (bad / "config.json").write_text(json.dumps({**tiny_config(heads["eagle3"]), **change}))
        with pytest.raises(ModelLoadError, match=message):
            load_head(bad, target, CPU, torch.float32)
    with pytest.raises(ModelLoadError, match="no EAGLE head is shipped"):
        LLM(str(tiny_model_dir), speculative_method="eagle")
