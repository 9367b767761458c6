"""Model resolution and safetensors loading, including every bad input a user can hand us."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM, MistralConfig

from streamsd.model.loader import (
    ModelLoadError,
    check_architecture,
    load_config,
    load_state_dict,
    resolve_model,
    streamsd_home,
)
from tests.tiny import build_model


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model that a test may break."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_streamsd_home(monkeypatch, tmp_path):
    monkeypatch.delenv("STREAMSD_HOME", raising=False)
    assert streamsd_home() == Path.home() / ".cache" / "streamsd"
    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path / "env"))
    assert streamsd_home() == tmp_path / "env"
    assert streamsd_home(tmp_path / "arg") == tmp_path / "arg"


def test_resolve_local_directory(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


def test_load_state_dict_keeps_hf_names_and_casts(tiny_model_dir):
    want = load_file(tiny_model_dir / "model.safetensors")
    got = load_state_dict(tiny_model_dir, dtype=torch.float32)
    assert got.keys() == want.keys() and "model.layers.0.self_attn.q_proj.weight" in got
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    half = load_state_dict(tiny_model_dir, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in half.values())


def test_load_sharded_checkpoint(tiny_model_dir, tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    got = load_state_dict(sharded, dtype=torch.float32)
    want = load_state_dict(tiny_model_dir, dtype=torch.float32)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_supported_architectures(tiny_model_dir, tmp_path, tiny_tokenizer):
    assert check_architecture(load_config(tiny_model_dir)) == "llama"
    qwen = build_model(tmp_path / "qwen", family="qwen2", tokenizer=tiny_tokenizer, layers=1)
    assert check_architecture(load_config(qwen)) == "qwen2"
    assert check_architecture(MistralConfig(architectures=["MistralForCausalLM"]).to_dict()) == "mistral"


@pytest.mark.parametrize("spec", ["./no-such-model", "/no/such/dir", "missing.gguf", "a/b/c"])
def test_missing_path(spec, tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model(spec, home=tmp_path)


def test_name_that_is_neither_path_nor_hub_id(tmp_path):
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        resolve_model("smollm2-135m", home=tmp_path)


def test_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # so "streamsd-test/absent" cannot be a local directory
    with pytest.raises(ModelLoadError, match="could not be downloaded.*local model directory or a .gguf"):
        resolve_model("streamsd-test/absent", home=tmp_path)


def test_directory_without_config_or_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(str(model_copy))
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(model_copy))


def test_plain_file_is_not_a_model(model_copy):
    with pytest.raises(ModelLoadError, match="is a file, not a model"):
        resolve_model(str(model_copy / "config.json"))


def test_corrupt_safetensors(model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated") as info:
        load_state_dict(model_copy, dtype=torch.float32)
    assert str(weights) in str(info.value)


def test_missing_shard(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors is missing"):
        load_state_dict(model_copy, dtype=torch.float32)


def test_bad_config_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_config(model_copy)


def test_unsupported_architecture(model_copy):
    config = json.loads((model_copy / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        check_architecture(load_config(model_copy))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))
