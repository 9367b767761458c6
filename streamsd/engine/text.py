"""A model's text side: prompts and chats to token ids, with its tokenizer and chat template.

The engine core holds one for its own work; a server whose core runs in another process builds its
own from the same files (`ChatText.load`), so prompts are tokenised where the requests arrive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamsd.engine.pieces import PieceCache
from streamsd.model.tokenizer import Tokenizer
from streamsd.request import ParamError


class ChatText:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None):
        """`chat_template`: used instead of the tokenizer's own; None: the tokenizer's."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.pieces = PieceCache.build(tokenizer)  # a chat's repeated messages tokenised once

    @classmethod
    def load(cls, model_dir: Path, chat_template: str | None) -> ChatText:
        from streamsd.model.loader import load_tokenizer

        return cls(load_tokenizer(model_dir), chat_template)

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode_rendered_chat(self.render_chat(messages))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None and not self.tokenizer.chat_template:
            raise ParamError("messages", "this model has no chat template; use the completions API or --chat-template")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  add_generation_prompt=add_generation_prompt)

    def encode_rendered_chat(self, text: str) -> list[int]:
        return self.pieces.encode(text)

    def encode_rendered_chat_within(self, text: str, new_chars: int) -> list[int] | None:
        """The ids where at most `new_chars` of the text need tokenising (the rest remembered), else None."""
        return self.pieces.encode_within(text, new_chars)
