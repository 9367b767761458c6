"""A `streamsd serve` process from start to exit: a model that cannot load, unreadable weights, a
drain that cuts answers short."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from streamsd.model.loader import ModelLoadError, check_readable, load_state_dict
from tests.server_util import free_port, start_server


@pytest.mark.parametrize("flags", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_server_whose_model_cannot_load_exits_non_zero_with_one_error_line(tmp_path, flags):
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "streamsd.cli", "serve", "--port", str(free_port()), "--device", "cpu",
           "--model", "/no/such/path", *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the server kept running without a model:\n{log.read_text()}")
    text = log.read_text()
    errors = [line for line in text.splitlines() if "ERROR" in line or line.startswith("error:")]
    assert rc != 0
    assert len(errors) == 1 and "/no/such/path" in errors[0], text
    assert "Traceback" not in text


def _load_as_nobody(model) -> str:
    """load_state_dict's verdict on `model` from a process running as `nobody` (root reads anything)."""
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        message = "loaded"
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            load_state_dict(model, dtype=torch.float32)
        except ModelLoadError as exc:
            message = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
            message = f"unexpected {exc!r}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        message = f.read().decode()
    os.waitpid(pid, 0)
    return message


def test_unreadable_weights_are_reported_as_permission_denied_for_the_user(tiny_model_dir):
    """Weights another user owns with mode 600, as a non-root container meets them on a mounted volume."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(tiny_model_dir, model)
        Path(tmp).chmod(0o755)
        model.chmod(0o755)
        weights = model / "model.safetensors"
        if os.geteuid() == 0:
            weights.chmod(0o600)
            message, user = _load_as_nobody(model), "nobody"
        else:
            weights.chmod(0o000)
            with pytest.raises(ModelLoadError) as info:
                load_state_dict(model, dtype=torch.float32)
            message, user = str(info.value), pwd.getpwuid(os.geteuid()).pw_name
        assert "permission denied" in message and str(weights) in message, message
        assert f"user {user} (uid " in message, message
        assert "missing" not in message
    check_readable(tiny_model_dir / "model.safetensors")  # readable: no error


@pytest.mark.parametrize("flags", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
def test_sigterm_ends_cut_streams_with_abort_and_refuses_queued_requests(tiny_model_dir, tmp_path, flags):
    """Streams cut by the drain end with finish_reason "abort"; requests still queued when it ends
    get 503, streaming or not. Streams that finish within the drain end normally."""
    s = start_server(tiny_model_dir, tmp_path, "--drain-timeout", "1.5", "--max-num-seqs", "2", *flags)

    async def scenario():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
            async def stream(i, max_tokens):
                events = []
                body = {"prompt": f"p{i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                    return r.status_code, events

            running = [asyncio.create_task(stream(i, 4000)) for i in range(2)]
            await asyncio.sleep(0.5)
            queued_stream = asyncio.create_task(stream(9, 8))
            queued = asyncio.create_task(ac.post("/v1/completions", json={"prompt": "q", "max_tokens": 8}))
            await asyncio.sleep(0.3)
            s.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*running), await queued_stream, await queued

    cut, (queued_status, queued_events), queued = asyncio.run(scenario())
    for status, events in cut:
        assert status == 200 and events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last
    assert queued_status == 503, queued_events
    assert queued.status_code == 503
    err = queued.json()["error"]
    assert err["code"] == "unavailable" and err["type"] == "server_error" and err["message"]
    assert s.proc.wait(30) == 0


def test_websocket_stream_cut_by_the_drain_is_done_with_abort(tiny_model_dir, tmp_path):
    websockets = pytest.importorskip("websockets")
    s = start_server(tiny_model_dir, tmp_path, "--drain-timeout", "0.5", "--no-access-log")

    async def scenario():
        async with websockets.connect(f"ws://127.0.0.1:{s.port}/v1/ws") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "prompt": "x", "max_tokens": 4000,
                                      "ignore_eos": True}))
            assert json.loads(await ws.recv())["type"] == "delta"
            s.proc.send_signal(signal.SIGTERM)
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if msg["type"] == "done":
                    return msg

    done = asyncio.run(scenario())
    assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] < 4000
    assert s.proc.wait(30) == 0
    time.sleep(0.1)
    log = s.log.read_text()
    for line in ("WebSocket /v1/ws", '"GET /health', "connection open"):
        assert line not in log, f"--no-access-log still logged {line}"
