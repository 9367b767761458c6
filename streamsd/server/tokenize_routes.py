"""vLLM's tokenisation routes: /tokenize and /detokenize, with the tokens the completion routes
run (the same encoding, the same chat template), and /version."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamsd import __version__
from streamsd.server.openai_routes import read_body
from streamsd.server.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize_decoder,
    encoder,
    tokenize_decoder,
)
from streamsd.server.state import ApiError, ServerState


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.streamsd
    engine, prompts = state.ready()
    body: TokenizeRequest = await read_body(request, tokenize_decoder)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
    if body.messages is None:
        if body.add_generation_prompt is not None:
            raise ApiError(400, "add_generation_prompt applies to messages only", param="add_generation_prompt")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids, strs = await prompts.tokenize_text(body.prompt or "", special, body.return_token_strs)
    else:
        # As the chat route runs them: the template adds any special tokens.
        special = bool(body.add_special_tokens)
        generation = True if body.add_generation_prompt is None else body.add_generation_prompt
        ids, strs = await prompts.tokenize_chat(body.messages, generation, special, body.return_token_strs)
    return Response(encoder.encode({"count": len(ids), "max_model_len": engine.info.max_model_len,
                                    "tokens": ids, "token_strs": strs}), media_type="application/json")


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.streamsd
    _, prompts = state.ready()
    body: DetokenizeRequest = await read_body(request, detokenize_decoder)
    state.check_model(body.model)
    return Response(encoder.encode({"prompt": await prompts.detokenize(body.tokens)}), media_type="application/json")


async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})
