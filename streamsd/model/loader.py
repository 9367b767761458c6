"""Find a model and read its weights.

`resolve_model` turns what the user typed after `--model` into a local HF directory (config.json,
safetensors, tokenizer files): the embedded default, a directory, a `.gguf` file (converted once
and cached) or a hub id. `load_state_dict` reads the safetensors straight into tensors with HF
names; `load_config` and `check_architecture` read and vet config.json; `load_tokenizer`,
`eos_ids_of` and `chat_template_of` give the tokenizer, every id that ends a generation and the chat
template a user passed, checked; `load_model` puts all of it together into a Transformer on a device.

Every failure a user can cause is a `ModelLoadError` whose message is one sentence saying what is
wrong and what to do; the CLI prints it without a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from streamsd.model.arch import ModelArgs
from streamsd.model.llama import Transformer
from streamsd.model.tokenizer import Tokenizer, read_tokenizer

# architectures entry -> model_type; SmolLM and SmolLM2 are plain Llama.
SUPPORTED_ARCHITECTURES = MappingProxyType({
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
})
# Enough to run a model; skips .bin/.pt/.onnx/.gguf duplicates a hub repo may also carry.
_HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelLoadError(Exception):
    """A model could not be found, fetched, converted or read; the message says what to do."""


def streamsd_home(home: Path | None = None) -> Path:
    """The cache root: `home` if given, else `$STREAMSD_HOME`, else `~/.cache/streamsd`."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("STREAMSD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "streamsd"


def resolve_model(spec: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """A local HF model directory for `spec` (default name, directory, .gguf file or hub id)."""
    from streamsd.model.default_model import DEFAULT_MODEL_NAME, pull_default

    if spec == DEFAULT_MODEL_NAME:
        return pull_default(home, progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        return validate_model_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _converted_gguf(path, home, progress=progress)
        raise ModelLoadError(
            f"{spec} is a file, not a model; pass the directory holding config.json and the safetensors, "
            "or a .gguf file"
        )
    if _looks_like_path(spec):
        raise ModelLoadError(f"no such file or directory: {spec}")
    return _download_from_hub(spec)


def validate_model_dir(model_dir: Path) -> Path:
    """`model_dir` if it has a config.json and safetensors weights, else a ModelLoadError."""
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json; pass a Hugging Face model directory or a .gguf file")
    if not weight_files(model_dir):
        raise ModelLoadError(
            f"{model_dir} has no *.safetensors weights (streamsd does not read .bin checkpoints); "
            "convert them with transformers' save_pretrained"
        )
    return model_dir


def load_config(model_dir: Path) -> dict[str, Any]:
    """`model_dir`'s config.json (model/arch.py reads it, with transformers' defaults)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path} does not exist; pass a Hugging Face model directory") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}); restore or re-download it") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object; restore or re-download it")
    return config


def check_architecture(config: dict[str, Any]) -> str:
    """The model_type of a supported config ("llama", "mistral" or "qwen2"); else a ModelLoadError."""
    model_type = config.get("model_type")
    archs = list(config.get("architectures") or [])
    bad = [a for a in archs if SUPPORTED_ARCHITECTURES.get(a) != model_type]
    if model_type in SUPPORTED_ARCHITECTURES.values() and not bad:
        return str(model_type)
    name = ", ".join(bad or archs) or f"model_type {model_type!r}"
    supported = ", ".join(f"{a} ({t})" for a, t in SUPPORTED_ARCHITECTURES.items())
    raise ModelLoadError(
        f"unsupported model architecture {name}; streamsd runs {supported}, SmolLM included"
    )


def load_state_dict(
    model_dir: Path, *, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of `model_dir`'s safetensors (one file or sharded), HF names, floats cast to dtype."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights; pass a Hugging Face model directory")
    target = torch.device(device)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        check_readable(file)
        try:
            # Reading straight onto the target device skips a host copy of every tensor on CUDA.
            with safe_open(str(file), framework="pt", device=str(target)) as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except FileNotFoundError as exc:
            raise ModelLoadError(f"weights file {file} is missing; re-download or re-convert the model") from exc
        except Exception as exc:  # safetensors raises its own SafetensorError, or OSError on short reads
            raise ModelLoadError(
                f"cannot read weights file {file} ({exc}); it is corrupt or truncated, re-download or "
                "re-convert the model"
            ) from exc
    return state


def check_readable(file: Path) -> None:
    """A ModelLoadError naming the user when this process may not read `file`. safetensors reports a
    permission error as a missing file; a non-root container meeting another user's mode-600 weights
    on a mounted volume must hear what is really wrong. Opening the file is the only faithful test
    (root reads anything whatever its mode)."""
    try:
        os.close(os.open(file, os.O_RDONLY))
    except PermissionError as exc:
        uid = os.geteuid()
        try:
            import pwd

            user = pwd.getpwuid(uid).pw_name
        except (ImportError, KeyError):  # no passwd entry (an arbitrary container uid), or not POSIX
            user = "?"
        raise ModelLoadError(
            f"permission denied reading weights file {file} as user {user} (uid {uid}); make it readable by "
            "that user (chmod/chown, or run as its owner)"
        ) from exc
    except FileNotFoundError as exc:
        raise ModelLoadError(f"weights file {file} is missing; re-download or re-convert the model") from exc


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({exc}); re-download it") from exc
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))


def _looks_like_path(spec: str) -> bool:
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        return True
    seps = {s for s in (os.sep, os.altsep) if s is not None}
    # "org/name" is a hub id even though it contains the separator; anything deeper is a path.
    return any(s in spec for s in seps) and not _HUB_ID.match(spec)


def _converted_gguf(gguf: Path, home: Path | None, *, progress: bool) -> Path:
    from streamsd.model.gguf_convert import convert_gguf_to_hf

    stat = gguf.stat()
    # Size + mtime identify the file without hashing gigabytes on every start.
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = streamsd_home(home) / "converted" / f"{gguf.stem}-{key}"
    return convert_gguf_to_hf(gguf, out, progress=progress)


def _download_from_hub(repo_id: str) -> Path:
    from streamsd.model.default_model import DEFAULT_MODEL_NAME

    hint = "pass a local model directory or a .gguf file instead"
    if not _HUB_ID.match(repo_id):
        raise ModelLoadError(
            f"no such file or directory, and not a hub id of the form org/name: {repo_id} "
            f"(the embedded default model is {DEFAULT_MODEL_NAME})"
        )
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, allow_patterns=list(_HUB_PATTERNS)))
    except ImportError as exc:
        raise ModelLoadError(f"model {repo_id} could not be downloaded (huggingface_hub is missing); {hint}") from exc
    except Exception as exc:  # offline, unknown repo, gated repo, HTTP errors: all the same to the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"model {repo_id} could not be downloaded from the hub ({reason}); {hint}") from exc
    return validate_model_dir(path)


def load_tokenizer(path: Path) -> Tokenizer:
    try:
        return read_tokenizer(path)
    except Exception as exc:  # the tokenizers library and transformers raise many kinds here
        raise ModelLoadError(f"could not load the tokenizer from {path}: {exc}") from exc


def eos_ids_of(path: Path, tokenizer: Tokenizer, args: ModelArgs) -> frozenset[int]:
    ids = set(args.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def chat_template_of(given: str | None, tokenizer: Tokenizer) -> str | None:
    """--chat-template as the template's text (read from the file it names, if it names one), checked by
    rendering a short conversation with it."""
    if given is None:
        return None
    try:
        is_file = Path(given).is_file()
    except OSError:  # a one-line template longer than a file name may be
        is_file = False
    template = Path(given).read_text(encoding="utf-8") if is_file else given
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], chat_template=template,
                                      add_generation_prompt=True)
    except Exception as exc:  # jinja's and transformers' own errors
        raise ValueError(f"--chat-template does not render a conversation: {exc}") from exc
    return template


def load_model(spec: str, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Path]:
    """A model by name, directory, .gguf file or hub id (or a preset's random weights), on `device`."""
    from streamsd.model.presets import build_preset, is_preset  # presets read configs through this module

    if is_preset(spec):  # random weights of a real shape, made on the device (benchmarks)
        return build_preset(spec, device, dtype)
    path = resolve_model(spec)
    config = load_config(path)
    check_architecture(config)
    args = ModelArgs.from_config(config)
    weights = load_state_dict(path, dtype=dtype, device=device)
    try:
        return Transformer.build(args, weights, device, dtype), path
    except (RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"the weights in {path} do not fit its config.json: {exc}") from exc
