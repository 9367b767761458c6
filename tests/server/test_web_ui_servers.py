"""The chat page against servers started per test: the exact mode's claim, proposer legends, an API key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server import web_ui_helpers as web_ui
from tests.server.web_ui_helpers import ask, expect, get_models, serve_for_ui, set_settings
from tests.tls import self_signed, trusting

# The browser, the servers and the page factory are web_ui_helpers.py's fixtures.
browser = web_ui.browser
new_page = web_ui.new_page

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def tiny_head_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """An untrained EAGLE head for the tiny target: enough for a server to run it."""
    import torch

    from streamsd.model.loader import load_model
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


def test_the_empty_chat_says_what_the_exact_mode_guarantees(new_page, tiny_model_dir, close_draft_dir, tmp_path):
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--draft-model", str(close_draft_dir), "--exact"]
    with serve_for_ui(args, tmp_path / "serve.log") as base:
        assert get_models(base)["speculation"]["exact"] is True
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
    with serve_for_ui(["--model", str(tiny_model_dir), "--device", "cpu", *args], tmp_path / "serve.log") as base:
        spec = get_models(base)["speculation"]
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
    with serve_for_ui(args, log, tls=trusting(cert)) as base:
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
        set_settings(page, max_tokens=8)
        ask(page, "Hello there")
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
        ask(other, "Hi")
        page.close()  # before the server goes: their reconnects would log errors
        other.close()
    assert any(u.startswith("wss://") for u in urls) and any(u.endswith("/v1/models") for u in urls), urls
    assert other_urls[0] == f"{base}/?api_key={key}"  # the navigation the test itself made
    assert not [u for u in urls + other_urls[1:] if key in u]
    assert key not in log.read_text()
