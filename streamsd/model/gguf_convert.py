"""Convert a GGUF file once into a standard Hugging Face directory.

The weights are dequantised to float32 by transformers' GGUF support, the tokenizer and its chat
template come from the GGUF metadata, and everything is written with `save_pretrained`, so the
result loads in plain transformers as well as in streamsd's own forward.

We call `load_gguf_checkpoint` on a model built from the GGUF config rather than
`AutoModelForCausalLM.from_pretrained(gguf_file=...)`: the latter needs `accelerate` and attaches a
GGUF quantizer that refuses `save_pretrained`; both give bit-identical float32 weights.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from streamsd.model.loader import ModelLoadError, check_architecture

MARKER = "streamsd-converted.json"
# llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2 regex, as
# SmolLM's own tokenizer.json does; transformers' GGUF tokenizer builder does not know that name.
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})


def is_converted(model_dir: Path) -> bool:
    """True when `model_dir` holds a finished conversion (the marker is written last)."""
    return (Path(model_dir) / MARKER).is_file()


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Write `gguf_path` as an HF directory at `out_dir` and return it.

    The work happens in a sibling temp directory renamed into place at the end, so a crash never
    leaves a half-written `out_dir`. An existing finished `out_dir` is returned untouched.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, tmp, progress=progress)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _convert_into(gguf_path: Path, tmp: Path, *, progress: bool) -> None:
    steps = tqdm(total=4, desc=f"converting {gguf_path.name}", unit="step", disable=not progress,
                 file=sys.stderr)
    # transformers adds its own per-tensor bar while dequantising (it reads no switch to hide it).
    with steps:
        steps.set_postfix_str("reading metadata")
        metadata = _gguf_metadata(gguf_path)
        config = _load_config(gguf_path)
        _check_convertible(gguf_path, config, metadata)
        steps.update()
        steps.set_postfix_str("tokenizer")
        tokenizer = _load_tokenizer(gguf_path, metadata, config.max_position_embeddings)
        steps.update()
        steps.set_postfix_str("dequantising weights")
        model = _load_model(gguf_path, config)
        steps.update()
        steps.set_postfix_str("writing safetensors")
        model.generation_config = _generation_config(config, tokenizer, metadata)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"source": gguf_path.name, "size": gguf_path.stat().st_size, "format": 1}
        _make_readable(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        steps.update()


def _publish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() and not is_converted(out_dir):
        shutil.rmtree(out_dir)  # unfinished (no marker): not ours to keep
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process finished the same conversion first; its copy is as good as ours.
        if not is_converted(out_dir):
            raise


def _make_readable(tmp: Path) -> None:
    # mkdtemp creates 0700 and some writers 0600; a shared model cache should be world-readable.
    tmp.chmod(0o755)
    for path in tmp.iterdir():
        path.chmod(0o644)


def _gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """The scalar and string metadata we need beyond what transformers reads."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:  # gguf raises ValueError, struct errors, etc. on a bad file
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file ({exc}); check the file") from exc
    keys = ("tokenizer.chat_template", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id")
    metadata = {key: reader.fields[key].contents() for key in keys if key in reader.fields}
    metadata["rope_freqs"] = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    return metadata


def _check_convertible(gguf_path: Path, config: Any, metadata: dict[str, Any]) -> None:
    # Fail before minutes of dequantising, not after.
    check_architecture(config)
    if metadata["rope_freqs"]:
        # llama.cpp bakes llama3 RoPE scaling into this tensor, and transformers' GGUF config reader
        # drops it: converting would silently change the model's positions.
        raise ModelLoadError(
            f"{gguf_path.name} uses Llama 3.1-style RoPE scaling, which its GGUF form cannot carry over; "
            "pass the model's Hugging Face directory instead"
        )


def _load_config(gguf_path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as exc:  # "GGUF model with architecture X is not supported yet"
        raise ModelLoadError(f"cannot convert {gguf_path.name}: {exc}") from exc


def _load_tokenizer(gguf_path: Path, metadata: dict[str, Any], max_length: int) -> Any:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = metadata.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.model_max_length = max_length  # else transformers saves "unlimited" (1e30)
    if metadata.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return tokenizer


def _load_model(gguf_path: Path, config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                  torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    # A tied lm_head is the embedding itself, so it is legitimately absent from the file.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelLoadError(
            f"cannot convert {gguf_path.name}: its tensors do not match the {config.model_type} layout "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return model.eval()


def _generation_config(config: Any, tokenizer: Any, metadata: dict[str, Any]) -> Any:
    from transformers import GenerationConfig

    # An end-of-turn token (llama.cpp's eot) ends a chat reply just as eos does.
    eos = [metadata.get("tokenizer.ggml.eos_token_id", config.eos_token_id),
           metadata.get("tokenizer.ggml.eot_token_id")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    pad = metadata.get("tokenizer.ggml.padding_token_id", tokenizer.pad_token_id)
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
        pad_token_id=pad,
    )

