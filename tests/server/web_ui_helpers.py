"""What the chat page's browser tests share (headless Chromium: Debian's /usr/bin/chromium driven by Python
playwright): the browser, the servers and a page factory (module-scoped fixtures a test module binds as its own,
``browser = web_ui.browser``), and helpers to fill the page in and record its socket.

Two kinds of test:

* Live: a real ``streamsd serve`` (uvicorn subprocess, tiny random target + draft) serves the page
  and answers its WebSocket (test_web_ui_live.py, test_web_ui_servers.py, test_chat_ui.py).
* Scripted: the tiny random model cannot be steered into Markdown, errors or dropped sockets, so
  these tests load the same page from ``web/`` and play the server with Playwright's WebSocket
  routing (``page.route_web_socket``). The app's real socket, frame handling and rendering run
  unchanged: the test only decides which frames the "server" sends (test_web_ui_scripted.py). The
  renderer is also tested directly by importing ``web/markdown.js`` in the page and rendering fixed
  strings (test_web_ui_markdown.py).

Every test fails on any console error or uncaught page exception (``new_page``).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.server_util import free_port

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


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} missing (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextlib.contextmanager
def serve_for_ui(args: list[str], log_path: Path, ready_timeout_s: float = 120, tls: ssl.SSLContext | None = None):
    """Run ``streamsd serve ARGS`` on a free loopback port until /health answers 200; yield its URL.
    ``tls``: the server speaks https (its certificate in ARGS), trusted through this context."""
    port = free_port()
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
    with serve_for_ui(args, tmp_path_factory.mktemp("serve") / "serve.log") as base:
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


def set_settings(page, **values) -> None:
    for name, value in values.items():
        page.locator(f"#settings-form [name={name}]").fill(str(value))


def send_message(page, text: str) -> None:
    page.get_by_test_id("prompt").fill(text)
    page.get_by_test_id("prompt").press("Enter")


def record_ws(page) -> dict:
    """Frames the page sends and receives on its sockets, parsed."""
    frames: dict = {"sent": [], "received": []}

    def on_ws(ws):
        ws.on("framesent", lambda payload: frames["sent"].append(json.loads(payload)))
        ws.on("framereceived", lambda payload: frames["received"].append(json.loads(payload)))

    page.on("websocket", on_ws)
    return frames


def get_models(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
        return json.load(r)["data"][0]


MODELS = {
    "object": "list",
    "data": [{"id": "tiny", "object": "model", "owned_by": "streamsd", "max_model_len": 512}],
}


def open_chat(page, base: str) -> None:
    """Load the chat page from `base` and wait for its socket to open."""
    page.goto(base)
    expect(page.locator("#conn")).to_have_attribute("data-state", "open")


def ask(page, text: str, n: int | None = None, timeout: float = 60_000):
    """Send `text` (the n-th question of the conversation on screen, when given) and wait for its reply."""
    send_message(page, text)
    if n is not None:
        expect(page.get_by_test_id("assistant-message")).to_have_count(n)
    reply = page.get_by_test_id("assistant-message").last
    expect(reply).to_have_attribute("data-status", "done", timeout=timeout)
    return reply
