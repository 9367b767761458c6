"""The chat page against a live server with a draft model: streaming, stop, stats and provenance tints."""

from __future__ import annotations

import json
import re

import pytest

from tests.server import web_ui_helpers as web_ui
from tests.server.web_ui_helpers import (
    ask,
    expect,
    get_models,
    open_chat,
    record_ws,
    send_message,
    set_settings,
)

# The browser, the servers and the page factory are web_ui_helpers.py's fixtures.
browser = web_ui.browser
live_server = web_ui.live_server
new_page = web_ui.new_page

pytestmark = pytest.mark.browser


STAT_NUMBER = re.compile(r"\d")


def _alnum(text: str) -> str:
    return re.sub(r"[\W_]", "", text)


def test_message_streams_and_stats_fill_in(new_page, live_server):
    page = new_page()
    frames = record_ws(page)
    open_chat(page, live_server)
    set_settings(page, max_tokens=64, temperature=0.8)
    reply = ask(page, "Once upon a time")
    deltas = [f for f in frames["received"] if f["type"] == "delta"]
    done = [f for f in frames["received"] if f["type"] == "done"]
    assert len(deltas) >= 2, "the reply should arrive in several delta frames"
    assert len(done) == 1 and done[0]["usage"]["completion_tokens"] > 0
    # Each token of each delta became a span; their text is the reply's text.
    spans = reply.locator(".md .tok")
    streamed = "".join(d["text"] for d in deltas)
    # Whitespace stays outside the spans: a sampled reply of the tiny model may be nothing else.
    assert spans.count() > 0 or not streamed.strip(), repr(streamed)
    # Random output may contain Markdown markers, so compare letters and digits only.
    assert _alnum(reply.locator(".md").inner_text()) == _alnum(streamed)

    generate = next(f for f in frames["sent"] if f["type"] == "generate")
    assert generate["messages"] == [{"role": "user", "content": "Once upon a time"}]
    assert generate["max_tokens"] == 64 and generate["temperature"] == 0.8
    assert generate["speculative"] == {"enabled": True, "num_tokens": 4}

    stats = page.get_by_test_id("stats")
    for key in ("reply-tps", "reply-ttft", "reply-tokens", "session-tps", "session-tokens"):
        assert STAT_NUMBER.search(stats.locator(f'[data-stat="{key}"]').inner_text()), key
    spec = done[0]["usage"].get("speculative") or {}
    if spec.get("drafted"):
        assert STAT_NUMBER.search(stats.locator('[data-stat="reply-acceptance"]').inner_text())
        assert STAT_NUMBER.search(stats.locator('[data-stat="reply-mean"]').inner_text())

    # The second turn sends the whole conversation again.
    ask(page, "And then?", n=2)
    second = [f for f in frames["sent"] if f["type"] == "generate"][1]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == streamed
    assert page.get_by_test_id("stats").locator('[data-stat="session-replies"]').inner_text() == "2"


def test_stop_cancels_the_reply(new_page, live_server):
    page = new_page()
    frames = record_ws(page)

    # The tiny model may pick end-of-sequence at any step; ignore_eos (a server extension the UI
    # does not expose) keeps it talking until the test stops it. The page's frames still go to
    # the real server, only with that one field added.
    def proxy(ws):
        server = ws.connect_to_server()

        def to_server(message):
            frame = json.loads(message)
            if frame.get("type") == "generate":
                frame["ignore_eos"] = True
            server.send(json.dumps(frame))

        ws.on_message(to_server)

    page.route_web_socket(re.compile(r".*/v1/ws.*"), proxy)
    open_chat(page, live_server)
    set_settings(page, max_tokens=400)
    send_message(page, "Count")

    reply = page.get_by_test_id("assistant-message").last
    expect(page.get_by_test_id("stop")).to_be_visible()
    expect(reply.locator(".tok").first).to_be_attached(timeout=30_000)
    page.get_by_test_id("stop").click()

    expect(reply).to_have_attribute("data-status", "done", timeout=10_000)
    expect(reply.locator(".foot")).to_contain_text("stopped")
    expect(page.get_by_test_id("send")).to_be_visible()
    expect(page.get_by_test_id("stop")).to_be_hidden()
    sent_id = next(f["id"] for f in frames["sent"] if f["type"] == "generate")
    assert {"type": "cancel", "id": sent_id} in frames["sent"]
    done = next(f for f in frames["received"] if f["type"] == "done")
    assert done["finish_reason"] == "cancelled"
    streamed = sum(len(f["tokens"]) for f in frames["received"] if f["type"] == "delta")
    assert 0 < streamed < 400


def test_provenance_tints_draft_tokens(new_page, live_server):
    page = new_page(color_scheme="light")
    open_chat(page, live_server)
    # Greedy: the same reply every run (an unseeded T=1 reply once held no target token the page could
    # show), and the close draft is accepted often enough that 150 tokens hold many drafts.
    set_settings(page, max_tokens=150, temperature=0)
    reply = ask(page, "Once upon a time")

    draft = reply.locator(".tok.draft").first
    expect(draft).to_be_attached()
    background = "el => getComputedStyle(el).backgroundColor"
    before = draft.evaluate(background)
    toggle = page.get_by_test_id("provenance-toggle")
    expect(toggle).to_have_attribute("aria-checked", "false")
    toggle.click()
    expect(toggle).to_have_attribute("aria-checked", "true")
    page.wait_for_timeout(300)  # the tint fades in over 0.15 s
    after = draft.evaluate(background)
    assert before == "rgba(0, 0, 0, 0)" and after != before
    target = reply.locator(".tok:not(.draft)").first
    assert target.evaluate(background) == "rgba(0, 0, 0, 0)", "only draft tokens are tinted"

    toggle.click()
    page.wait_for_timeout(300)
    assert draft.evaluate(background) == before


SEAMS = """reply => {
  const spans = [...reply.querySelectorAll('.md .tok')];
  const pairs = [];
  for (const a of spans) {
    const b = a.nextSibling;
    if (!b || !b.classList || !b.classList.contains('tok')) continue;  // whitespace or markup between
    const ra = a.getClientRects(), rb = b.getClientRects();
    const last = ra[ra.length - 1], first = rb[0];
    if (Math.abs(last.top - first.top) > 1) continue;  // a line break between them
    pairs.push({ gap: first.left - last.right, a: a.textContent, b: b.textContent });
  }
  const style = (s) => { const c = getComputedStyle(s); return [c.paddingLeft, c.paddingRight, c.marginLeft,
    c.marginRight, c.borderLeftWidth, c.borderRightWidth, c.borderTopLeftRadius, c.borderTopRightRadius]; };
  return {
    texts: spans.map((s) => s.textContent),
    draftStyles: [...new Set(spans.filter((s) => s.classList.contains('draft')).map((s) => style(s).join(' ')))],
    pairs,
  };
}"""


def test_provenance_tints_visible_text_and_words_read_continuous(new_page, live_server):
    """A token's leading whitespace is not tinted, and a word made of several tokens shows no seam:
    the spans of adjacent tokens touch, with no padding, margin, border or rounding between them."""
    page = new_page(color_scheme="light")
    frames = record_ws(page)
    open_chat(page, live_server)
    set_settings(page, max_tokens=150, temperature=0)
    reply = ask(page, "Once upon a time")
    page.get_by_test_id("provenance-toggle").click()
    page.wait_for_timeout(300)

    tokens = [t["text"] for f in frames["received"] if f["type"] == "delta" for t in f["tokens"]]
    assert any(t[:1].isspace() and t.strip() for t in tokens), "the reply should hold tokens that start with a space"
    seams = reply.evaluate(SEAMS)
    assert seams["texts"], "the reply should be rendered as token spans"
    padded = [t for t in seams["texts"] if t != t.strip() or not t]
    assert not padded, f"token spans hold whitespace at their edges: {padded[:5]}"
    assert seams["draftStyles"] == ["0px 0px 0px 0px 0px 0px 0px 0px"], seams["draftStyles"]
    assert seams["pairs"], "the reply should hold words made of several tokens"
    gaps = [p for p in seams["pairs"] if abs(p["gap"]) > 0.01]
    assert not gaps, f"adjacent token spans do not touch: {gaps[:5]}"
    # Whitespace left outside the spans is still in the reply.
    assert _alnum(reply.locator(".md").inner_text()) == _alnum("".join(tokens))


def test_legend_names_the_draft_model_the_server_runs(new_page, live_server, close_draft_dir):
    assert get_models(live_server)["speculation"] == {
        "method": "draft", "num_tokens": 4, "draft_model": close_draft_dir.name, "tree": None, "exact": False,
    }
    page = new_page()
    page.goto(live_server)
    legend = page.get_by_test_id("legend")
    expect(legend).to_contain_text(f"proposed by draft model {close_draft_dir.name}, accepted by the target")
    expect(page.get_by_test_id("claim")).to_contain_text("not what the model may say")
