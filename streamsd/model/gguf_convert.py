"""Convert a GGUF file once into a standard Hugging Face directory.

The file is read once, through a memory map (gguf_file.py): its metadata gives the config
(gguf_layout.py), its tensors are dequantised to float32 one at a time by gguf's dequantisers and
written as safetensors under their HF names; the tokenizer and its chat template come from the
metadata through transformers' GGUF tokenizer support. The result loads in plain transformers as well
as in streamsd's own forward, and its weights are those transformers' own GGUF loader produces (the
tests compare the two).

transformers' GGUF model path is not used: it read the file four times with gguf's GGUFReader (which
makes a numpy view per element of every metadata array: 5-10 s per read for SmolLM2's vocabulary on a
2-core machine) and rebuilt the tensor-name map once per module (9 s), so a 135M model took 35 s.

`generation_config.json` gets the end-of-turn tokens and the sampling defaults the file carries
(llama.cpp's `general.sampling.*`), or those the caller passes (the embedded default model's card).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from streamsd.model.gguf_file import GgufError, GgufFile
from streamsd.model.gguf_layout import hf_config_dict, hf_tensor_name, unpermute_rotary
from streamsd.model.loader import ModelLoadError, check_architecture

MARKER = "streamsd-converted.json"
FORMAT = 2  # 2: sampling defaults in generation_config.json; older conversions are redone
# llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2 regex, as
# SmolLM's own tokenizer.json does; transformers' GGUF tokenizer builder does not know that name.
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})
# llama.cpp's sampling metadata -> generation_config.json fields
_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                  "general.sampling.penalty_repeat": "repetition_penalty"}
_METADATA_STRINGS = ("tokenizer.chat_template", "tokenizer.ggml.pre")


def is_converted(model_dir: Path) -> bool:
    """True when `model_dir` holds a finished conversion of the current format (the marker is written last)."""
    try:
        return json.loads((Path(model_dir) / MARKER).read_text()).get("format", 1) >= FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, progress: bool = True,
                       sampling: Mapping[str, float] | None = None) -> Path:
    """Write `gguf_path` as an HF directory at `out_dir` and return it. `sampling`: generation defaults
    (temperature, top_p, ...) to write when the file carries none of its own.

    The work happens in a sibling temp directory renamed into place at the end, so a crash never
    leaves a half-written `out_dir`. An existing finished `out_dir` is returned untouched.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, tmp, progress=progress, sampling=dict(sampling or {}))
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _convert_into(gguf_path: Path, tmp: Path, *, progress: bool, sampling: dict[str, float]) -> None:
    try:
        gguf = GgufFile.open(gguf_path, _METADATA_STRINGS)
    except (GgufError, OSError) as exc:
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file ({exc}); check the file") from exc
    try:
        names = list(gguf.tensors)
        config, fields = _config(gguf_path, gguf.metadata, set(names))
        bar = tqdm(total=len(names) + 2, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress,
                   file=sys.stderr)
        with bar:
            bar.set_postfix_str("tokenizer")
            tokenizer = _load_tokenizer(gguf_path, gguf.metadata, config.max_position_embeddings)
            bar.update()
            bar.set_postfix_str("dequantising weights")
            state = {}
            for name in names:
                state[hf_tensor_name(name)] = _tensor(gguf, name, fields)
                bar.update()
            bar.set_postfix_str("writing")
            _write(tmp, config, state, tokenizer, _generation_config(config, tokenizer, gguf.metadata, sampling))
            marker = {"source": gguf_path.name, "size": gguf_path.stat().st_size, "format": FORMAT}
            _make_readable(tmp)
            (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            bar.update()
    finally:
        gguf.close()


def _config(gguf_path: Path, metadata: dict[str, Any], names: set[str]) -> tuple[Any, dict[str, Any]]:
    """transformers' config object, and the fields it was made from."""
    from transformers import AutoConfig

    # Fail before dequantising, not after.
    if "rope_freqs.weight" in names:
        # llama.cpp bakes llama3 RoPE scaling into this tensor, which no config field carries:
        # converting would silently change the model's positions.
        raise ModelLoadError(
            f"{gguf_path.name} uses Llama 3.1-style RoPE scaling, which its GGUF form cannot carry over; "
            "pass the model's Hugging Face directory instead"
        )
    fields = hf_config_dict(metadata, names)
    try:
        config = AutoConfig.for_model(**fields)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"cannot convert {gguf_path.name}: {exc}") from exc
    check_architecture(config.to_dict())
    return config, fields


def _tensor(gguf: GgufFile, name: str, config: dict[str, Any]) -> Any:
    import numpy as np
    import torch

    weight = unpermute_rotary(name, gguf.float32(name), config)
    return torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))  # a copy: F32 data is the map itself


def _write(tmp: Path, config: Any, state: dict[str, Any], tokenizer: Any, generation: Any) -> None:
    from safetensors.torch import save_file

    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding itself, as save_pretrained leaves it out
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    generation.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def _publish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() and not is_converted(out_dir):
        shutil.rmtree(out_dir)  # unfinished (no marker) or an older format: not ours to keep
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


def _load_tokenizer(gguf_path: Path, metadata: dict[str, Any], max_length: int) -> Any:
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The fast tokenizer class itself: AutoTokenizer would first read the whole file once more, with
    # gguf's slow reader, only to learn the model type (the GGUF's tokenizer is complete either way).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
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


def _generation_config(config: Any, tokenizer: Any, metadata: dict[str, Any], sampling: dict[str, float]) -> Any:
    from transformers import GenerationConfig

    # An end-of-turn token (llama.cpp's eot) ends a chat reply just as eos does.
    eos = [metadata.get("tokenizer.ggml.eos_token_id", config.eos_token_id),
           metadata.get("tokenizer.ggml.eot_token_id")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    pad = metadata.get("tokenizer.ggml.padding_token_id", tokenizer.pad_token_id)
    own = {field: metadata[key] for key, field in _SAMPLING_KEYS.items() if key in metadata}
    chosen = own or sampling  # the file's own, else the caller's (a model card's)
    values = {field: int(v) if field == "top_k" else float(v) for field, v in chosen.items()}
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
        pad_token_id=pad,
        **({"do_sample": True, **values} if values else {}),
    )
