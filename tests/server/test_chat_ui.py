"""The chat page as a daily user has it: saved conversations, regenerate and edit, a system prompt,
the speculation view and a phone-sized layout. Headless Chromium against a real ``streamsd serve``
(tiny random target and a close draft model), with the fixtures of web_ui_helpers.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.server import web_ui_helpers as web_ui
from tests.server.web_ui_helpers import ask, expect, open_chat, record_ws, serve_for_ui, set_settings

# The browser, the live server and the page factory are web_ui_helpers.py's fixtures.
browser = web_ui.browser
live_server = web_ui.live_server
new_page = web_ui.new_page

pytestmark = pytest.mark.browser

DONE_S = 60_000
DOCS = Path(__file__).resolve().parents[2] / "docs"
SCREENSHOT_TURNS = [
    "Add type hints to `def area(width, height): return width * height`",
    "Now write it out again with a docstring.",
]


def _dones(frames: dict) -> list[dict]:
    return [f for f in frames["received"] if f["type"] == "done"]


def test_conversations_are_kept_across_a_reload_and_reopen_with_their_messages(new_page, live_server):
    page = new_page()
    open_chat(page, live_server)
    set_settings(page, max_tokens=12, temperature=0.8)
    first = ask(page, "Tell me about rivers", 1).locator(".md").inner_text()
    ask(page, "And lakes?", 2)
    page.get_by_test_id("new-chat").click()
    expect(page.get_by_test_id("assistant-message")).to_have_count(0)
    ask(page, "Name a mountain", 1)

    page.reload()
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    items = page.get_by_test_id("conversation-list").get_by_test_id("conversation-item")
    expect(items).to_have_count(2)
    # Newest first, titled by the first question.
    expect(items.nth(0)).to_contain_text("Name a mountain")
    expect(items.nth(1)).to_contain_text("Tell me about rivers")

    items.nth(1).locator(".conv-open").click()
    expect(page.locator(".msg.user .bubble")).to_have_text(["Tell me about rivers", "And lakes?"])
    expect(page.get_by_test_id("assistant-message")).to_have_count(2)
    assert page.get_by_test_id("assistant-message").first.locator(".md").inner_text() == first
    expect(page.get_by_test_id("assistant-message").first.locator(".foot")).to_contain_text("tokens")

    # Rename by keyboard, then delete the other one.
    items.nth(1).locator("[data-action=rename]").click()
    box = page.get_by_label("New title")
    box.fill("Water")
    box.press("Enter")
    expect(items.filter(has_text="Water")).to_have_count(1)
    items.filter(has_text="Name a mountain").locator("[data-action=delete]").click()
    expect(items).to_have_count(1)
    page.reload()
    expect(page.get_by_test_id("conversation-item")).to_have_count(1)
    expect(page.get_by_test_id("conversation-item")).to_contain_text("Water")


def test_conversations_export_to_json_and_import_in_another_browser(new_page, live_server, tmp_path):
    page = new_page()
    open_chat(page, live_server)
    set_settings(page, max_tokens=6, temperature=0)
    page.get_by_test_id("system-prompt").fill("Be brief.")
    reply = ask(page, "Export me", 1).locator(".md").inner_text()
    with page.expect_download() as download:
        page.get_by_test_id("export-chats").click()
    path = tmp_path / "chats.json"
    download.value.save_as(path)
    doc = json.loads(path.read_text())
    [conv] = doc["conversations"]
    assert conv["title"] == "Export me" and conv["system"] == "Be brief."
    assert [t["user"] for t in conv["turns"]] == ["Export me"] and conv["turns"][0]["text"] == reply

    other = new_page()  # a fresh context: its own, empty IndexedDB
    open_chat(other, live_server)
    expect(other.get_by_test_id("conversation-item")).to_have_count(0)
    other.locator("#import-chats").set_input_files(path)
    expect(other.get_by_test_id("conversation-item")).to_have_count(1)
    other.get_by_test_id("conversation-item").locator(".conv-open").click()
    expect(other.locator(".msg.user .bubble")).to_have_text(["Export me"])
    assert other.get_by_test_id("assistant-message").locator(".md").inner_text() == reply
    expect(other.get_by_test_id("system-prompt")).to_have_value("Be brief.")


def test_regenerate_replaces_the_last_answer_with_a_new_one(new_page, live_server):
    page = new_page()
    frames = record_ws(page)
    open_chat(page, live_server)
    set_settings(page, max_tokens=24, temperature=1.0)
    ask(page, "Once upon a time", 1)
    before = "".join(f["text"] for f in frames["received"] if f["type"] == "delta")
    page.get_by_test_id("regenerate").click()
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "done", timeout=DONE_S)
    expect(page.get_by_test_id("assistant-message")).to_have_count(1)
    generates = [f for f in frames["sent"] if f["type"] == "generate"]
    assert len(generates) == 2 and generates[0]["messages"] == generates[1]["messages"]
    second_id = generates[1]["id"]
    after = "".join(f["text"] for f in frames["received"] if f["type"] == "delta" and f["id"] == second_id)
    assert after != before, "an unseeded T=1 reply of 24 tokens came out the same twice"


def test_editing_the_first_question_replaces_the_later_turns(new_page, live_server):
    page = new_page()
    frames = record_ws(page)
    open_chat(page, live_server)
    set_settings(page, max_tokens=8, temperature=0.8)
    ask(page, "First question", 1)
    ask(page, "Second question", 2)
    page.get_by_test_id("edit-message").first.click()
    box = page.get_by_label("Edit your question")
    expect(box).to_be_focused()
    box.fill("A better first question")
    box.press("Enter")
    expect(page.get_by_test_id("assistant-message")).to_have_count(1)
    expect(page.get_by_test_id("assistant-message")).to_have_attribute("data-status", "done", timeout=DONE_S)
    expect(page.locator(".msg.user .bubble")).to_have_text(["A better first question"])
    last = [f for f in frames["sent"] if f["type"] == "generate"][-1]
    assert last["messages"] == [{"role": "user", "content": "A better first question"}]


def test_the_system_prompt_reaches_the_model(new_page, live_server):
    page = new_page()
    frames = record_ws(page)
    open_chat(page, live_server)
    set_settings(page, max_tokens=4, temperature=0)
    ask(page, "Hello", 1)
    page.get_by_test_id("new-chat").click()
    page.get_by_test_id("system-prompt").fill("You are a pirate who answers in rhymes about the sea.")
    ask(page, "Hello", 1)
    sent = [f for f in frames["sent"] if f["type"] == "generate"]
    assert sent[1]["messages"][0] == {"role": "system", "content": "You are a pirate who answers in rhymes about the sea."}
    plain, with_system = (d["usage"]["prompt_tokens"] for d in _dones(frames))
    assert with_system > plain + 5, (plain, with_system)
    # The system prompt is the conversation's: reopened with it, once the store holds both conversations
    # (the list is redrawn after each save; a reload before that would lose the unsaved one).
    expect(page.get_by_test_id("conversation-item")).to_have_count(2)
    page.reload()
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    page.get_by_test_id("conversation-item").first.locator(".conv-open").click()
    expect(page.get_by_test_id("system-prompt")).to_have_value(re.compile("pirate"))


def test_speculation_view_charts_acceptance_by_position_and_the_steps(new_page, live_server):
    page = new_page()
    frames = record_ws(page)
    open_chat(page, live_server)
    expect(page.get_by_test_id("spec-proposer")).to_contain_text("draft model")
    set_settings(page, max_tokens=60, temperature=0, spec_k=4)
    ask(page, "Once upon a time", 1)
    done = _dones(frames)[0]
    spec = done["usage"]["speculative"]
    assert spec["accepted"] > 0 and len(spec["drafted_per_position"]) == 4
    assert sum(spec["drafted_per_position"]) == spec["drafted"]
    assert sum(spec["accepted_per_position"]) == spec["accepted"]
    deltas = [f for f in frames["received"] if f["type"] == "delta"]
    assert all("step" in d for d in deltas)
    assert sum(d["step"]["accepted"] for d in deltas) == spec["accepted"]

    chart = page.get_by_test_id("spec-position-chart")
    expect(chart.locator(".spec-col")).to_have_count(4)
    heights = chart.locator(".bar.reply").evaluate_all("bars => bars.map((b) => b.getBoundingClientRect().height)")
    assert max(heights) > 0, "some position was accepted, so its bar has height"
    strip = page.get_by_test_id("spec-step-strip")
    expect(strip.locator(".step")).to_have_count(len(deltas))
    expect(strip.locator(".step.on").first).to_be_attached()
    expect(page.get_by_test_id("spec-summary")).to_contain_text("cached")


def test_the_page_fits_a_phone(new_page, live_server):
    page = new_page(viewport={"width": 375, "height": 740})
    open_chat(page, live_server)
    page.get_by_test_id("prompt").fill("Hello")
    page.keyboard.press("Enter")
    expect(page.get_by_test_id("assistant-message")).to_have_attribute("data-status", "done", timeout=DONE_S)
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    for toggle in ("#history-toggle", "#panel-toggle"):
        page.locator(toggle).click()
        assert page.evaluate("document.documentElement.scrollWidth") <= 375
        page.keyboard.press("Escape")
    # Every control has a name a screen reader can say.
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, textarea')]
        .filter((e) => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim()
                && !e.closest('[hidden]') && e.type !== 'file')
        .map((e) => e.outerHTML)""")
    assert unnamed == []


@pytest.mark.slow
def test_readme_screenshots(new_page, tmp_path):
    """docs/chat-{desktop,phone}-{light,dark}.png for the README: two saved chats, the open one with a
    system prompt and two finished turns, provenance on, from the embedded default model
    (SmolLM2-135M-Instruct; pulled on first use). A real model, because the tiny random one only
    produces noise; slow, because on a CPU it runs at ~10 tokens/s."""
    with serve_for_ui(["--device", "cpu"], tmp_path / "serve.log", ready_timeout_s=900) as base:
        page = new_page(color_scheme="light", viewport={"width": 1180, "height": 760})
        open_chat(page, base)
        set_settings(page, temperature=0, max_tokens=60)
        ask(page, "What is a haiku?", 1)
        page.get_by_test_id("new-chat").click()
        page.get_by_test_id("system-prompt").fill("You are a helpful Python assistant.")
        set_settings(page, max_tokens=160)
        for n, text in enumerate(SCREENSHOT_TURNS, start=1):
            ask(page, text, n)
        page.get_by_test_id("provenance-toggle").click()
        expect(page.locator("[data-testid=assistant-message] .tok.draft").first).to_be_attached()
        page.locator("#prompt").blur()
        page.locator("#sidebar").evaluate("e => { e.scrollTop = 0; }")
        shots = []
        for size, viewport in (("desktop", {"width": 1180, "height": 760}), ("phone", {"width": 375, "height": 720})):
            page.set_viewport_size(viewport)
            for scheme in ("light", "dark"):
                page.emulate_media(color_scheme=scheme)
                page.wait_for_timeout(300)
                assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
                path = DOCS / f"chat-{size}-{scheme}.png"
                page.screenshot(path=str(path))
                shots.append(path)
        page.close()  # before the server stops, or its reconnect attempts log errors
    for path in shots:
        assert 10_000 < path.stat().st_size < 200_000, (path, path.stat().st_size)
