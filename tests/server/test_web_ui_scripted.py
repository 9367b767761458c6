"""The chat page with the server played by the test: Markdown replies, errors, reconnects, keys, keyboard."""

from __future__ import annotations

import json
import re

import pytest

from tests.server import web_ui_helpers as web_ui
from tests.server.web_ui_helpers import MODELS, expect, send_message, set_settings

# The browser, the servers and the page factory are web_ui_helpers.py's fixtures.
browser = web_ui.browser
static_server = web_ui.static_server
new_page = web_ui.new_page

pytestmark = pytest.mark.browser


MARKDOWN_REPLY = (
    "## Plan\n\nUse **bold**, *em* and `code`.\n\n- one\n- two\n\n"
    "```python\nprint('<b>hi</b>')\n```\n\n<script>window.__pwned = 1</script> <img src=x onerror=\"window.__pwned = 2\">"
)


def _tokens(text: str, size: int = 3) -> list[dict]:
    """Cut text into fake tokens, every other one marked as a draft."""
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [{"id": i, "text": t, "draft": i % 2 == 0} for i, t in enumerate(pieces)]


def _stream(ws, rid: str, text: str, per_frame: int = 2) -> None:
    toks = _tokens(text)
    for i in range(0, len(toks), per_frame):
        chunk = toks[i : i + per_frame]
        ws.send(
            json.dumps(
                {"type": "delta", "id": rid, "text": "".join(t["text"] for t in chunk), "tokens": chunk}
            )
        )
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": len(toks),
        "total_tokens": 5 + len(toks),
        "speculative": {"drafted": 40, "accepted": 30, "acceptance_rate": 0.75, "mean_accepted_length": 2.5},
    }
    timing = {"ttft_s": 0.02, "elapsed_s": 0.5, "steps": 12}
    ws.send(
        json.dumps({"type": "done", "id": rid, "finish_reason": "stop", "usage": usage, "timing": timing})
    )


def _scripted_page(new_page, static_server, script):
    """Load web/ with /v1/ws answered by ``script(ws, frame, connection_number)``."""
    page = new_page()
    page.route("**/v1/models", lambda route: route.fulfill(json=MODELS))
    connections = []

    def handler(ws):
        connections.append(ws)
        n = len(connections)
        ws.on_message(lambda message: script(ws, json.loads(message), n))

    page.route_web_socket(re.compile(r".*/v1/ws.*"), handler)
    page.goto(static_server)
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    return page, connections


def test_markdown_reply_renders_code_and_keeps_script_as_text(new_page, static_server):
    def script(ws, frame, _n):
        if frame["type"] == "generate":
            _stream(ws, frame["id"], MARKDOWN_REPLY)

    page, _ = _scripted_page(new_page, static_server, script)
    expect(page.locator("#model-name")).to_have_text("tiny")
    send_message(page, "Show me markdown")
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "done")

    expect(reply.locator("h2")).to_have_text("Plan")
    expect(reply.locator("strong")).to_have_text("bold")
    expect(reply.locator("ul > li")).to_have_count(2)
    expect(reply.locator("pre > code")).to_have_text("print('<b>hi</b>')")
    expect(reply.locator(".code-block button.copy")).to_be_visible()
    assert reply.locator("script, img, b").count() == 0
    expect(reply.locator("p").last).to_contain_text("<script>window.__pwned = 1</script>")
    assert page.evaluate("window.__pwned") is None
    # Provenance survives the Markdown: draft tokens are spans inside the code block too.
    assert reply.locator("pre code .tok.draft").count() > 0
    expect(reply.locator(".foot")).to_contain_text("75 % accepted")
    expect(page.locator('[data-stat="reply-acceptance"]')).to_have_text("75 %")
    expect(page.locator('[data-stat="reply-mean"]')).to_have_text("2.50")

    page.locator(".code-block button.copy").click()  # no error, even where the clipboard is denied
    expect(page.locator(".code-block button.copy")).not_to_have_text("Copy")


def test_error_frame_is_shown_and_the_message_can_be_retried(new_page, static_server):
    def script(ws, frame, _n):
        if frame["type"] != "generate":
            return
        if not script.failed:
            script.failed = True
            ws.send(
                json.dumps(
                    {
                        "type": "error",
                        "id": frame["id"],
                        "error": {"message": "queue is full", "code": "queue_full"},
                    }
                )
            )
        else:
            _stream(ws, frame["id"], "Second time lucky.")

    script.failed = False
    page, _ = _scripted_page(new_page, static_server, script)
    send_message(page, "Hello")
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "failed")
    expect(reply.locator(".error")).to_have_text("queue is full")
    reply.get_by_role("button", name="Retry").click()
    expect(reply).to_have_attribute("data-status", "done")
    expect(reply.locator(".md")).to_have_text("Second time lucky.")
    expect(page.get_by_test_id("assistant-message")).to_have_count(1)


def test_connection_loss_reconnects_and_retry_works(new_page, static_server):
    def script(ws, frame, n):
        if frame["type"] != "generate":
            return
        if n == 1:
            toks = _tokens("This reply will be cut")
            ws.send(
                json.dumps({"type": "delta", "id": frame["id"], "text": toks[0]["text"], "tokens": toks[:1]})
            )
            ws.close(code=1011, reason="server went away")
        else:
            _stream(ws, frame["id"], "Back again.")

    page, connections = _scripted_page(new_page, static_server, script)
    send_message(page, "Hello")
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "failed")
    expect(reply.locator(".error")).to_contain_text("lost")
    expect(page.locator("#banner")).to_contain_text("Reconnecting")
    # Backoff brings the socket back by itself (first retry within a second).
    expect(page.locator("#conn")).to_have_attribute("data-state", "open", timeout=5_000)
    expect(page.locator("#banner")).to_be_hidden()
    assert len(connections) == 2
    reply.get_by_role("button", name="Retry").click()
    expect(reply).to_have_attribute("data-status", "done")
    expect(reply.locator(".md")).to_have_text("Back again.")


def test_api_key_in_the_page_address_moves_out_of_it_into_headers(new_page, static_server):
    page = new_page()
    auth, sockets = [], []

    def models(route):
        auth.append(route.request.headers.get("authorization"))
        route.fulfill(json=MODELS)

    page.route("**/v1/models", models)
    page.route_web_socket(re.compile(r".*/v1/ws.*"), lambda ws: sockets.append(ws.url))
    page.goto(f"{static_server}/?api_key=s3cret&x=1#top")
    assert page.url == f"{static_server}/?x=1#top"
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    expect(page.locator("#model-name")).to_have_text("tiny")
    assert sockets == [f"{static_server.replace('http', 'ws')}/v1/ws"]
    assert auth and set(auth) == {"Bearer s3cret"}
    assert page.evaluate("sessionStorage.getItem('streamsd.apiKey')") == "s3cret"


def test_keyboard_new_chat_and_settings(new_page, static_server):
    received = []

    def script(ws, frame, _n):
        received.append(frame)
        if frame["type"] == "generate":
            _stream(ws, frame["id"], "ok")

    page, _ = _scripted_page(new_page, static_server, script)
    prompt = page.get_by_test_id("prompt")
    expect(prompt).to_be_focused()
    prompt.press_sequentially("line one")
    prompt.press("Shift+Enter")
    prompt.press_sequentially("line two")
    expect(prompt).to_have_value("line one\nline two")
    page.locator("#spec_enabled").uncheck()
    set_settings(page, top_p=0.9)
    prompt.press("Enter")
    expect(page.get_by_test_id("assistant-message")).to_have_attribute("data-status", "done")
    generate = received[-1]
    assert generate["messages"] == [{"role": "user", "content": "line one\nline two"}]
    assert generate["speculative"] == {"enabled": False} and generate["top_p"] == 0.9
    expect(prompt).to_have_value("")

    # Settings survive a reload; a new chat starts an empty conversation.
    page.reload()
    expect(page.locator("#spec_enabled")).not_to_be_checked()
    expect(page.locator("#spec_k")).to_be_disabled()
    expect(page.locator("#top_p")).to_have_value("0.9")
    page.get_by_role("button", name="New chat").click()
    expect(page.get_by_test_id("assistant-message")).to_have_count(0)
