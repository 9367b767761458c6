"""A model's tokenizer for serving: the tokenizers library's Rust tokenizer, its named special tokens
and its chat template.

Read straight from `tokenizer.json` and `tokenizer_config.json` where transformers would load them
unchanged (its generic tokenizer classes, every special token already in the vocabulary, no flags
that rewrite the pipeline), so that a start does not import transformers: seconds of single-threaded
Python that, on a thread beside the CUDA-graph capture, held the GIL the capture needs. Any other
directory loads through transformers' AutoTokenizer and is wrapped the same way. Either way the
methods are the subset of transformers' tokenizer API the engine uses, with transformers' results
(tests/model/test_tokenizer.py compares them); `transformers()` gives the transformers object itself
for what needs one (the grammar engine), loaded on first use.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer as RustTokenizer

from streamsd.model.chat_template import render as render_chat

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json classes that use tokenizer.json as it is
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# model types whose tokenizer transformers takes from tokenizer_config.json (for others, qwen2 among
# them, it picks a class of its own that may rebuild the split pattern whatever the config says)
_GENERIC_FAMILIES = frozenset({"llama", "mistral"})
# keys that change nothing transformers does with tokenizer.json (the special tokens are checked apart)
_INERT_KEYS = frozenset({"backend", "tokenizer_class", "added_tokens_decoder", "model_max_length", "chat_template",
                         "is_local", "local_files_only", "name_or_path", "padding_side", "truncation_side",
                         "model_input_names", "extra_special_tokens", "additional_special_tokens",
                         "clean_up_tokenization_spaces", "errors", *SPECIAL_NAMES})


class Tokenizer:
    """Use `read_tokenizer`. `hf`: the transformers tokenizer it was read through, if it was."""

    def __init__(self, backend: RustTokenizer, special: Mapping[str, str], template: str | dict[str, str] | None,
                 path: Path | None, hf: Any = None, extra: Sequence[str] = ()):
        self.backend_tokenizer = backend  # transformers' name for it, which callers of either use
        self.special = dict(special)  # bos_token, eos_token, ... -> its text: what templates see
        self.extra = tuple(extra)  # further special tokens the config names
        self.chat_template = template
        self.path = path
        self.direct = hf is None  # read without transformers
        # transformers' text clean-up after decoding, which only its own decode does
        self._cleans_up = hf is not None and bool(hf.clean_up_tokenization_spaces)
        self._hf = hf
        self._lock = threading.Lock()
        self.eos_token_id = self._id("eos_token")
        self.pad_token_id = self._id("pad_token")
        self.bos_token_id = self._id("bos_token")

    def _id(self, name: str) -> int | None:
        text = self.special.get(name)
        return self.backend_tokenizer.token_to_id(text) if text is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it works (the single one holds it: a long prompt would
        # stall the engine's thread for as long as it takes).
        return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self._cleans_up:
            return str(self._hf.decode(ids, skip_special_tokens=skip_special_tokens))
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def text_decoder(self) -> Callable[[list[int]], str]:
        """ids -> text without special tokens, as fast as it goes: straight to the Rust tokenizer (a
        detokenizer decodes twice a token) unless transformers' clean-up applies."""
        if self._cleans_up:
            return functools.partial(self.decode, skip_special_tokens=True)
        return functools.partial(self.backend_tokenizer.decode, skip_special_tokens=True)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        tokens = [self.backend_tokenizer.id_to_token(i) for i in ids]
        if None in tokens:
            raise ValueError("token ids outside the vocabulary")
        return cast(list[str], tokens)

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the named special tokens and of the config's extra special tokens."""
        ids = {self.backend_tokenizer.token_to_id(t) for t in (*self.special.values(), *self.extra)}
        return sorted(i for i in ids if i is not None)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = False) -> str:
        """The conversation as prompt text (the engine tokenises it apart), by `chat_template` (a
        template's text, or the name of one of the model's templates) or the model's own."""
        return render_chat(self._template(chat_template), messages, self.special, add_generation_prompt)

    def _template(self, given: str | None) -> str:
        own = self.chat_template
        if isinstance(own, dict):
            if given is not None:
                return own.get(given, given)
            if "default" not in own:
                raise ValueError(f"this model's chat templates are named {sorted(own)}; none is the default")
            return own["default"]
        if given is not None:
            return given
        if own is None:
            raise ValueError("this model has no chat template")
        return own

    def transformers(self) -> Any:
        """The transformers tokenizer of the same directory (imports transformers: seconds, once)."""
        with self._lock:
            if self._hf is None:
                if self.path is None:
                    raise ValueError("this tokenizer was not read from a directory")
                self._hf = _auto_tokenizer(self.path)
            return self._hf


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of the model directory `path`, read directly where transformers would read it
    unchanged, else through transformers. Raises OSError or ValueError for a directory without a
    readable tokenizer."""
    config = _read_json(path / "tokenizer_config.json")
    special, extra = _special_tokens(path, config), _extra_special_tokens(config)
    backend = _direct_backend(path, config, [*special.values(), *extra])
    if backend is None:
        hf = _auto_tokenizer(path)
        special = {k: str(v) for k, v in hf.special_tokens_map.items() if k in SPECIAL_NAMES}
        extra = [hf.convert_ids_to_tokens(i) for i in hf.all_special_ids]
        return Tokenizer(hf.backend_tokenizer, special, hf.chat_template, path, hf, extra)
    return Tokenizer(backend, special, _chat_template(path, config), path, extra=extra)


def _direct_backend(path: Path, config: dict[str, Any], specials: list[str]) -> RustTokenizer | None:
    """tokenizer.json as transformers would use it, or None where transformers would change it
    (`specials`: the special tokens' texts, which must all be in it already)."""
    file = path / "tokenizer.json"
    if not file.is_file() or config.get("tokenizer_class") not in _GENERIC_CLASSES:
        return None
    if set(config) - _INERT_KEYS or config.get("clean_up_tokenization_spaces"):
        return None
    family = _read_json(path / "config.json").get("model_type")
    if family not in _GENERIC_FAMILIES:
        return None
    backend = RustTokenizer.from_file(str(file))
    if backend.get_vocab_size() > 100_000 and family == "mistral":
        return None  # transformers rewrites some Mistral tokenizers' split pattern
    added = {int(i): _text(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
    if any(backend.token_to_id(text) != i for i, text in added.items()):
        return None  # transformers would add these tokens
    if any(backend.token_to_id(t) is None for t in specials):
        return None
    backend.no_truncation()
    backend.no_padding()
    return backend


def _special_tokens(path: Path, config: dict[str, Any]) -> dict[str, str]:
    legacy = _read_json(path / "special_tokens_map.json")
    out = {}
    for name in SPECIAL_NAMES:
        value = config.get(name, legacy.get(name))
        if value is not None:
            out[name] = _text(value)
    return out


def _extra_special_tokens(config: dict[str, Any]) -> list[str]:
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or ()
    return [_text(t) for t in (extra.values() if isinstance(extra, Mapping) else extra)]


def _chat_template(path: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja, else chat_template.json, else the config's (a list of named templates
    becomes a dict), as transformers reads them."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = _read_json(path / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value


def _text(token: Any) -> str:
    """A special token's text: configs write a string or an AddedToken's fields."""
    return str(token["content"]) if isinstance(token, Mapping) else str(token)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
