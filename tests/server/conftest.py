"""The server most of these tests talk to: a real `streamsd serve` (uvicorn) on 127.0.0.1 speculating
with a tiny draft model at a fixed k, one per test module, and an openai client for it. A module
that needs another server defines its own `server` fixture."""

from __future__ import annotations

import openai
import pytest

from tests.server_util import start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, close_draft_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--draft-model", str(close_draft_dir),
                     "--num-speculative-tokens", "3", "--speculation-policy", "fixed")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
