"""The engine is built on the thread its steps run on: the warm-up's per-thread CUDA state (a cuBLAS
handle and its workspace) then serves the first request instead of being created under it."""

from __future__ import annotations

import threading
import time

from starlette.testclient import TestClient

from streamsd.config import EngineConfig
from streamsd.engine.builder import build_runtime
from streamsd.engine.core import EngineCore
from streamsd.server.app import create_app
from streamsd.server.state import ServerState


def test_the_engine_is_built_on_the_thread_that_runs_its_steps(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), device="cpu")
    built_on: list[int] = []

    def factory() -> EngineCore:
        built_on.append(threading.get_ident())
        return EngineCore(build_runtime(cfg), cfg.spec)

    state = ServerState(served_model_name="tiny")
    with TestClient(create_app(state, factory)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        workers = [t.ident for t in threading.enumerate() if t.name.startswith("streamsd-worker")]
    assert workers == built_on
