"""Wire types (msgspec) for the OpenAI routes and the WebSocket protocol, with their bounds.

msgspec rejects wrong types, out-of-range values and fields these types do not declare, with a
message naming the field; OpenAI fields declared here but not honoured are refused by
unsupported.py, and the remaining cross-field rules live in SamplingParams. Decoders and encoders
are built once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from streamsd.request import MAX_TOP_LOGPROBS

MAX_N = 128  # answers per request (n, and prompts x n on /v1/completions)
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# OpenAI's: token ids (JSON object keys, so strings on the wire) -> a bias in [-100, 100].
LogitBias = dict[Annotated[int, msgspec.Meta(ge=0)], Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
# /v1/completions also takes 0 with `echo`: the prompt scored, nothing generated (lm-eval's loglikelihood).
PromptMaxTokens = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]
StopList = str | Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]], msgspec.Meta(max_length=16)]
Role = Literal["system", "user", "assistant", "developer", "tool"]


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class Speculative(msgspec.Struct, forbid_unknown_fields=True):
    enabled: bool | None = None
    num_tokens: Annotated[int, msgspec.Meta(ge=0, le=16)] | None = None
    draft_greedy_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sampling fields every request kind shares (HTTP bodies and WebSocket frames)."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=1_000_000)] | None = None
    min_p: Prob | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: StopList | None = None
    stop_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=64)] | None = None
    ignore_eos: bool = False
    logprobs: bool | Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the end user, as a client labels it: nothing here depends on it
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    logit_bias: LogitBias | None = None
    speculative: Speculative | None = None
    # Structured output (server/structured.py): OpenAI's JSON mode and JSON schema, or a regex.
    response_format: dict[str, Any] | None = None
    guided_regex: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None


# How many answers an HTTP request asks for, each sampled on its own (with `seed` + its index).
N = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    n: N = 1
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or a list of prompts (strings or token-id lists), each answered n times.
    prompt: str | Annotated[list[int | str | Annotated[list[int], msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]
    max_tokens: PromptMaxTokens | None = None
    max_completion_tokens: PromptMaxTokens | None = None
    n: N = 1
    echo: bool = False
    best_of: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None


class WsGenerate(SamplingFields, tag="generate", tag_field="type", kw_only=True):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    messages: list[ChatMessage] | None = None
    prompt: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    add_special_tokens: bool | None = None  # default true for a prompt, false for messages (as the routes run)
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]


class WsCancel(msgspec.Struct, tag="cancel", tag_field="type"):
    id: str


WsClientMessage = WsGenerate | WsCancel

chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)
ws_decoder = msgspec.json.Decoder(WsClientMessage)
tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
encoder = msgspec.json.Encoder()
