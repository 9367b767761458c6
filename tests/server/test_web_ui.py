"""The chat page in headless Chromium (Debian's /usr/bin/chromium driven by Python playwright).

Two kinds of test:

* Live: a real ``streamsd serve`` (uvicorn subprocess, tiny random target + draft) serves the page
  and answers its WebSocket. A message streams, stop cancels, provenance tints draft tokens, the
  stats fill in. The README's screenshots come from test_chat_ui.py's ``test_readme_screenshots``.
* Scripted: the tiny random model cannot be steered into Markdown, errors or dropped sockets, so
  these tests load the same page from ``web/`` and play the server with Playwright's WebSocket
  routing (``page.route_web_socket``). The app's real socket, frame handling and rendering run
  unchanged: the test only decides which frames the "server" sends. The renderer is also tested
  directly by importing ``web/markdown.js`` in the page and rendering fixed strings.

Every test fails on any console error or uncaught page exception.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.tls import self_signed, trusting

pytestmark = pytest.mark.browser

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "web"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1200, "height": 800}


# ------------------------------------------------------------------------------------------
# Fixtures: browser, servers, page.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} missing (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextlib.contextmanager
def _serve(args: list[str], log_path: Path, ready_timeout_s: float = 120, tls: ssl.SSLContext | None = None):
    """Run ``streamsd serve ARGS`` on a free loopback port until /health answers 200; yield its URL.
    ``tls``: the server speaks https (its certificate in ARGS), trusted through this context."""
    port = _free_port()
    cmd = [sys.executable, "-m", "streamsd.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2, context=tls) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {ready_timeout_s} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def live_server(tiny_model_dir, close_draft_dir, tmp_path_factory):
    """A real streamsd server with the tiny target and a draft; yields its base URL.

    The draft is ``close_draft_dir`` (the target's weights plus noise), not ``tiny_draft_dir``:
    that one shares nothing with the target, so at chat temperatures the target accepts almost
    none of its drafts (0 of 786 at temperature 0.6 when measured) and there would be nothing
    for the provenance tint or the acceptance figures to show."""
    args = ["--model", str(tiny_model_dir), "--draft-model", str(close_draft_dir)]
    args += ["--speculative-method", "draft", "--speculation-policy", "fixed", "--device", "cpu"]
    with _serve(args, tmp_path_factory.mktemp("serve") / "serve.log") as base:
        yield base


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def static_server():
    """``web/`` over plain HTTP, for the scripted tests (the socket is played by the test)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=WEB))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def new_page(browser):
    """Opens pages that record console errors; the test fails if any were logged, but for those
    matching ``expected_errors`` (a regular expression)."""
    contexts, errors = [], []

    def make(expected_errors: str | None = None, **ctx_args):
        ctx = browser.new_context(**{"viewport": VIEWPORT, **ctx_args})
        contexts.append(ctx)
        page = ctx.new_page()

        def on_console(m):
            if m.type == "error" and not (expected_errors and re.search(expected_errors, m.text)):
                errors.append(f"console: {m.text}")

        page.on("console", on_console)
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        return page

    yield make
    for ctx in contexts:
        ctx.close()
    assert not errors, "the page logged errors:\n" + "\n".join(errors)


# ------------------------------------------------------------------------------------------
# Helpers.


def _set_settings(page, **values) -> None:
    for name, value in values.items():
        page.locator(f"#settings-form [name={name}]").fill(str(value))


def _send(page, text: str) -> None:
    page.get_by_test_id("prompt").fill(text)
    page.get_by_test_id("prompt").press("Enter")


def _record_ws(page) -> dict:
    """Frames the page sends and receives on its sockets, parsed."""
    frames: dict = {"sent": [], "received": []}

    def on_ws(ws):
        ws.on("framesent", lambda payload: frames["sent"].append(json.loads(payload)))
        ws.on("framereceived", lambda payload: frames["received"].append(json.loads(payload)))

    page.on("websocket", on_ws)
    return frames


STAT_NUMBER = re.compile(r"\d")


def _alnum(text: str) -> str:
    return re.sub(r"[\W_]", "", text)


# ------------------------------------------------------------------------------------------
# Live: the real server.


def test_message_streams_and_stats_fill_in(new_page, live_server):
    page = new_page()
    frames = _record_ws(page)
    page.goto(live_server)
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    _set_settings(page, max_tokens=64, temperature=0.8)
    _send(page, "Once upon a time")

    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "done", timeout=60_000)
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
    _send(page, "And then?")
    expect(page.get_by_test_id("assistant-message")).to_have_count(2)
    expect(page.get_by_test_id("assistant-message").last).to_have_attribute(
        "data-status", "done", timeout=60_000
    )
    second = [f for f in frames["sent"] if f["type"] == "generate"][1]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == streamed
    assert page.get_by_test_id("stats").locator('[data-stat="session-replies"]').inner_text() == "2"


def test_stop_cancels_the_reply(new_page, live_server):
    page = new_page()
    frames = _record_ws(page)

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
    page.goto(live_server)
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    _set_settings(page, max_tokens=400)
    _send(page, "Count")

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
    page.goto(live_server)
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    # Greedy: the same reply every run (an unseeded T=1 reply once held no target token the page could
    # show), and the close draft is accepted often enough that 150 tokens hold many drafts.
    _set_settings(page, max_tokens=150, temperature=0)
    _send(page, "Once upon a time")
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "done", timeout=60_000)

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
    frames = _record_ws(page)
    page.goto(live_server)
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")
    _set_settings(page, max_tokens=150, temperature=0)
    _send(page, "Once upon a time")
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "done", timeout=60_000)
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


@pytest.fixture(scope="module")
def tiny_head_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """An untrained EAGLE head for the tiny target: enough for a server to run it."""
    import torch

    from streamsd.engine.builder import load_model
    from streamsd.spec_decode.eagle.checkpoint import new_head, save_head

    target = load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)[0]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return save_head(new_head(target), tmp_path_factory.mktemp("head"), config, torch.float32)


PROPOSERS = {
    "ngram": (["--speculative-method", "ngram"], "proposed by n-gram lookup"),
    "eagle-chain": (["--speculative-method", "eagle", "--draft-model", "{head}"], "proposed by EAGLE head (chain)"),
    "eagle-tree": (["--speculative-method", "eagle", "--draft-model", "{head}", "--speculative-tree", "3,2,2,5"],
                   "proposed by EAGLE head (tree)"),
    "none": (["--speculative-method", "none"], "Speculation is off"),
}


def _models(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
        return json.load(r)["data"][0]


def test_legend_names_the_draft_model_the_server_runs(new_page, live_server, close_draft_dir):
    assert _models(live_server)["speculation"] == {
        "method": "draft", "num_tokens": 4, "draft_model": close_draft_dir.name, "tree": None, "exact": False,
    }
    page = new_page()
    page.goto(live_server)
    legend = page.get_by_test_id("legend")
    expect(legend).to_contain_text(f"proposed by draft model {close_draft_dir.name}, accepted by the target")
    expect(page.get_by_test_id("claim")).to_contain_text("not what the model may say")


def test_the_empty_chat_says_what_the_exact_mode_guarantees(new_page, tiny_model_dir, close_draft_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--draft-model", str(close_draft_dir), "--exact"]
    with _serve(args, tmp_path / "serve.log") as base:
        assert _models(base)["speculation"]["exact"] is True
        page = new_page()
        page.goto(base)
        claim = page.get_by_test_id("claim")
        expect(claim).to_contain_text("runs in exact mode: replies are token for token what it says without speculation")
        expect(page.get_by_test_id("legend")).to_contain_text(f"proposed by draft model {close_draft_dir.name}")
        page.close()  # before the server stops, or its reconnect attempts log errors


@pytest.mark.parametrize("kind", PROPOSERS)
def test_legend_names_the_proposer_the_server_runs(new_page, tiny_model_dir, tiny_head_dir, tmp_path, kind):
    args, wanted = PROPOSERS[kind]
    args = [a.format(head=tiny_head_dir) for a in args]
    with _serve(["--model", str(tiny_model_dir), "--device", "cpu", *args], tmp_path / "serve.log") as base:
        spec = _models(base)["speculation"]
        method = kind.split("-")[0]
        assert spec["method"] == method and spec["draft_model"] is None
        assert spec["tree"] == ("3,2,2,5" if kind == "eagle-tree" else None)
        page = new_page()
        page.goto(base)
        legend = page.get_by_test_id("legend")
        expect(legend).to_contain_text(wanted)
        expect(legend).not_to_contain_text("draft model")
        if kind == "none":
            assert spec["num_tokens"] == 0
            expect(legend.locator(".tok.draft")).to_have_count(0)
        page.close()  # before the server stops, or its reconnect attempts log errors


SCREENSHOT_TURNS = [
    "Add type hints to `def area(width, height): return width * height`",
    "Now write it out again with a docstring.",
]


def test_ui_asks_for_the_api_key_over_https_and_never_puts_it_in_an_address(new_page, tiny_model_dir, tmp_path):
    """Under --api-key (and TLS: the page and its socket over https and wss), the page asks for the
    key in a dialog, says when the server refuses one, and works once it has the right one; the
    key reaches no address: not the page's, not a request's, not the server's log."""
    key = "sk-ui-7f3Qz"
    cert, tls_key = self_signed(tmp_path, "server")
    log = tmp_path / "serve.log"
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--api-key", f"ui:{key}",
            "--ssl-certfile", str(cert), "--ssl-keyfile", str(tls_key)]
    urls: list[str] = []
    with _serve(args, log, tls=trusting(cert)) as base:
        # The browser logs each 401 the page's probe gets while it has no (right) key.
        page = new_page(expected_errors=r"status of 401", ignore_https_errors=True)
        page.on("request", lambda r: urls.append(r.url))
        page.on("websocket", lambda ws: urls.append(ws.url))
        page.goto(base)
        dialog = page.get_by_role("dialog", name="API key")
        expect(dialog).to_be_visible()
        field = dialog.get_by_label("API key")
        expect(field).to_be_focused()
        field.fill("sk-wrong")
        field.press("Enter")
        expect(dialog.get_by_role("alert")).to_have_text("The server refused this key.")
        expect(field).to_be_focused()
        field.fill(key)
        dialog.get_by_role("button", name="Connect").click()
        expect(dialog).to_be_hidden()
        expect(page.locator("#conn")).to_have_attribute("data-state", "open")
        expect(page.locator("#model-name")).to_have_text(tiny_model_dir.name)
        _set_settings(page, max_tokens=8)
        _send(page, "Hello there")
        expect(page.get_by_test_id("assistant-message").last).to_have_attribute("data-status", "done",
                                                                                 timeout=60_000)
        # This tab keeps the key: a reload asks nothing.
        page.reload()
        expect(page.locator("#conn")).to_have_attribute("data-state", "open")
        expect(dialog).to_be_hidden()
        assert page.url == f"{base}/"
        # A key given in the address anyway leaves it at once and is used from headers.
        other = new_page(ignore_https_errors=True)
        other_urls: list[str] = []
        other.on("request", lambda r: other_urls.append(r.url))
        other.on("websocket", lambda ws: other_urls.append(ws.url))
        other.goto(f"{base}/?api_key={key}")
        assert other.url == f"{base}/"
        expect(other.locator("#conn")).to_have_attribute("data-state", "open")
        expect(other.get_by_role("dialog", name="API key")).to_be_hidden()
        _send(other, "Hi")
        expect(other.get_by_test_id("assistant-message").last).to_have_attribute("data-status", "done",
                                                                                  timeout=60_000)
        page.close()  # before the server goes: their reconnects would log errors
        other.close()
    assert any(u.startswith("wss://") for u in urls) and any(u.endswith("/v1/models") for u in urls), urls
    assert other_urls[0] == f"{base}/?api_key={key}"  # the navigation the test itself made
    assert not [u for u in urls + other_urls[1:] if key in u]
    assert key not in log.read_text()


# ------------------------------------------------------------------------------------------
# Scripted: the page from web/, the server played by the test.

MODELS = {
    "object": "list",
    "data": [{"id": "tiny", "object": "model", "owned_by": "streamsd", "max_model_len": 512}],
}

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


def _quiet_page(new_page, static_server, **ctx_args):
    """Load web/ with a socket that opens and never speaks: for testing modules in the page."""
    page = new_page(**ctx_args)
    page.route("**/v1/models", lambda route: route.fulfill(json=MODELS))
    page.route_web_socket(re.compile(r".*/v1/ws.*"), lambda ws: None)
    page.goto(static_server)
    return page


def test_markdown_reply_renders_code_and_keeps_script_as_text(new_page, static_server):
    def script(ws, frame, _n):
        if frame["type"] == "generate":
            _stream(ws, frame["id"], MARKDOWN_REPLY)

    page, _ = _scripted_page(new_page, static_server, script)
    expect(page.locator("#model-name")).to_have_text("tiny")
    _send(page, "Show me markdown")
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
    _send(page, "Hello")
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
    _send(page, "Hello")
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
    _set_settings(page, top_p=0.9)
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


# ------------------------------------------------------------------------------------------
# The renderer itself, imported as a module in the browser.

RENDER = """async (cases) => {
  const { render } = await import('/markdown.js');
  return cases.map(([src, segments]) => {
    const div = document.createElement('div');
    div.append(render(src, segments ? { segments } : {}));
    div.querySelectorAll('button').forEach((b) => b.remove());  // the copy button is UI, not content
    return div.innerHTML;
  });
}"""

CASES = [
    ("Hello *world*", "<p>Hello <em>world</em></p>"),
    ("**bold** and __also__", "<p><strong>bold</strong> and <strong>also</strong></p>"),
    ("*a **b** c*", "<p><em>a <strong>b</strong> c</em></p>"),
    ("***both***", "<p><em><strong>both</strong></em></p>"),
    ("snake_case_name and 2*3*4", "<p>snake_case_name and 2<em>3</em>4</p>"),
    ("a * b * c", "<p>a * b * c</p>"),
    ("\\*not em\\* and `a*b*c`", "<p>*not em* and <code>a*b*c</code></p>"),
    ("`` a`b ``", "<p><code>a`b</code></p>"),
    ("# Title\n## Sub ##\nbody", "<h1>Title</h1><h2>Sub</h2><p>body</p>"),
    ("line one\nline two\n\nnext", "<p>line one\nline two</p><p>next</p>"),
    (
        "- a\n- b\n  - c\n- d",
        "<ul><li><p>a</p></li><li><p>b</p><ul><li><p>c</p></li></ul></li><li><p>d</p></li></ul>",
    ),
    ("3. three\n4. four", '<ol start="3"><li><p>three</p></li><li><p>four</p></li></ol>'),
    ("> quoted\n\n---", "<blockquote><p>quoted</p></blockquote><hr>"),
    (
        "```js\nif (a < b) {}\n```",
        '<div class="code-block"><div class="code-head"><span class="code-lang">js</span></div>'
        '<pre><code data-lang="js">if (a &lt; b) {}</code></pre></div>',
    ),
    # An unclosed fence (a reply still streaming) is already a code block.
    (
        "```\nopen",
        '<div class="code-block"><div class="code-head"><span class="code-lang"></span></div><pre><code>open</code></pre></div>',
    ),
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    (
        '<img src=x onerror="alert(1)"> [x](javascript:alert(1))',
        '<p>&lt;img src=x onerror="alert(1)"&gt; [x](javascript:alert(1))</p>',
    ),
    ("# <b>not bold</b>", "<h1>&lt;b&gt;not bold&lt;/b&gt;</h1>"),
]


def test_markdown_renderer(new_page, static_server):
    page = _quiet_page(new_page, static_server)
    got = page.evaluate(RENDER, [[src, None] for src, _ in CASES])
    for (src, want), html in zip(CASES, got, strict=True):
        assert html == want, src
    assert page.evaluate("window.__pwned") is None


def test_markdown_renderer_keeps_token_spans(new_page, static_server):
    page = _quiet_page(new_page, static_server)
    # Tokens "**ab" | " c" | "d**" : the markers vanish, the tokens keep their characters.
    segments = [
        {"start": 0, "end": 4, "draft": True},
        {"start": 4, "end": 6, "draft": False},
        {"start": 6, "end": 9, "draft": True},
    ]
    (html,) = page.evaluate(RENDER, [["**ab cd**", segments]])
    assert html == (
        '<p><strong><span class="tok draft">ab</span> <span class="tok">c</span>'
        '<span class="tok draft">d</span></strong></p>'
    )
    # Whitespace at a token's edges stays outside its span; a whitespace-only token has none.
    # Tokens "Hyd" | "rated" | " water" | " " | " ok " | "yes".
    bounds = [(0, 3, True), (3, 8, False), (8, 14, True), (14, 15, False), (15, 19, True), (19, 22, False)]
    segments = [{"start": a, "end": b, "draft": d} for a, b, d in bounds]
    (html,) = page.evaluate(RENDER, [["Hydrated water  ok yes", segments]])
    assert html == (
        '<p><span class="tok draft">Hyd</span><span class="tok">rated</span> <span class="tok draft">water</span>'
        '  <span class="tok draft">ok</span> <span class="tok">yes</span></p>'
    )

    # Code blocks keep their tokens too, newline included.
    segments = [
        {"start": 0, "end": 4, "draft": False},
        {"start": 4, "end": 8, "draft": True},
        {"start": 8, "end": 14, "draft": False},
    ]
    (html,) = page.evaluate(RENDER, [["```\nab\ncd\n```", segments]])
    assert '<code><span class="tok draft">ab\nc</span><span class="tok">d</span></code>' in html


def test_dark_theme_follows_the_system(new_page, static_server):
    colours = {}
    for scheme in ("light", "dark"):
        page = _quiet_page(new_page, static_server, color_scheme=scheme)
        colours[scheme] = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert colours["light"] != colours["dark"]


FUZZ = """async (n) => {
  const { render } = await import('/markdown.js');
  const alphabet = ['*', '_', '`', '#', '-', '+', '>', '\\\\', '\\n', '\\n', '1.', ' ', ' ', 'a', 'b', '~', '<', 'x', '\\t', '2)'];
  let seed = 7;
  const rand = () => (seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648;
  const lost = [];
  for (let k = 0; k < n; k++) {
    let src = '';
    for (let i = Math.floor(rand() * 40); i > 0; i--) src += alphabet[Math.floor(rand() * alphabet.length)];
    if (/^ {0,3}(```|~~~)/m.test(src)) continue;
    const segments = [];
    for (let i = 0; i < src.length; i += 2) segments.push({ start: i, end: Math.min(src.length, i + 2), draft: i % 4 === 0 });
    for (const opts of [{}, { segments }]) {
      const div = document.createElement('div');
      div.append(render(src, opts));
      div.querySelectorAll('button').forEach((b) => b.remove());
      if (div.textContent.replace(/[^abx]/g, '') !== src.replace(/[^abx]/g, '')) lost.push(src);
    }
  }
  return lost;
}"""


def test_markdown_renderer_never_loses_text(new_page, static_server):
    """Random Markdown-ish input (no fences, whose info strings are dropped by design): markup
    characters may be consumed, but every letter is rendered, with or without token spans."""
    page = _quiet_page(new_page, static_server)
    assert page.evaluate(FUZZ, 2000) == []
