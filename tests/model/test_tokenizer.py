"""The serving tokenizer gives transformers' results without importing transformers where it can."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from streamsd.model.chat_template import render
from streamsd.model.tokenizer import read_tokenizer

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>", " leading space", "Über naïve café 日本語 🚀", "",
         "a\n\n\tb  c<|endoftext|>"]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More", "name": None}],
]


def _same_as_transformers(model_dir: Path) -> None:
    ours, theirs = read_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == list(theirs.encode(text, add_special_tokens=special))
    ids = list(theirs.encode("<|im_start|>user\nÜber 🚀 x<|im_end|>", add_special_tokens=True))
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.text_decoder()(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == sorted(theirs.all_special_ids)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == \
        (theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id)
    for chat in CHATS:
        for prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
    given = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ eos_token }}"
    assert ours.apply_chat_template(CHATS[1], chat_template=given) == \
        theirs.apply_chat_template(CHATS[1], chat_template=given, tokenize=False)


def test_a_generic_tokenizer_is_read_directly_with_transformers_results(tiny_model_dir: Path) -> None:
    assert read_tokenizer(tiny_model_dir).direct
    _same_as_transformers(tiny_model_dir)


def test_the_default_model_is_read_directly_with_transformers_results() -> None:
    from streamsd.model.default_model import DEFAULT_MODEL_NAME
    from streamsd.model.loader import resolve_model

    try:
        path = resolve_model(DEFAULT_MODEL_NAME)
    except Exception:
        pytest.skip("the default model is not installed here")
    assert read_tokenizer(path).direct
    _same_as_transformers(path)


def test_a_tokenizer_transformers_would_reshape_loads_through_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A BOS flag can make transformers rebuild the post-processor: such a directory is read through
    transformers, with its results."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = read_tokenizer(tmp_path)
    assert not tok.direct
    _same_as_transformers(tmp_path)


def test_a_family_transformers_gives_its_own_tokenizer_class_loads_through_it(qwen_target_dir: Path) -> None:
    """transformers gives qwen2 models a tokenizer class of its own (it splits digits apart whatever
    tokenizer.json says): such a directory is read through transformers, with its results."""
    assert not read_tokenizer(qwen_target_dir).direct
    _same_as_transformers(qwen_target_dir)


def test_reading_a_model_and_its_tokenizer_does_not_import_transformers(tiny_model_dir: Path) -> None:
    code = ("import sys; from pathlib import Path; from streamsd.model.tokenizer import read_tokenizer; "
            f"t = read_tokenizer(Path({str(tiny_model_dir)!r})); t.apply_chat_template([{{'role': 'user', 'content': 'x'}}]); "
            "assert 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_named_templates_render_the_default_or_the_one_asked_for(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    templates = [{"name": "default", "template": "D{{ messages[0].content }}"},
                 {"name": "tool_use", "template": "T{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": templates}))
    tok = read_tokenizer(tmp_path)
    chat = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(chat) == "Dx"
    assert tok.apply_chat_template(chat, chat_template="tool_use") == "Tx"
    assert tok.apply_chat_template(chat, chat_template="{{ 'own' }}") == "own"


def test_templates_run_sandboxed_with_the_helpers_hub_templates_use() -> None:
    chat = [{"role": "user", "content": "é <b>", "reasoning": "because"}]
    assert render("{{ messages[0] | tojson }}", chat, {}, False) == \
        '{"thinking": "because", "role": "user", "content": "é <b>", "reasoning": "because", ' \
        '"reasoning_content": "because"}'
    assert render("{% generation %}{{ messages[0].content }}{% endgeneration %}", chat, {}, False) == "é <b>"
    assert render("{% for m in messages %}{% break %}{% endfor %}{{ bos_token }}", chat, {"bos_token": "<s>"}, True) == "<s>"
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        render("{{ raise_exception('no system role') }}", chat, {}, False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_x=1) %}", chat, {}, False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ messages.__class__.__subclasses__() }}", chat, {}, False)
    with pytest.raises(ValueError, match="at least one message"):
        render("x", [], {}, False)
