"""Run the app under uvicorn (uvloop, httptools, websockets-sansio) with a graceful drain.

SIGTERM: /health turns 503 and new requests get 503 at once; running requests get up to
`drain_timeout` seconds to finish, then are cut: their answers end with finish_reason "abort", and
those still queued (never run) get 503; the process exits 0.
A second SIGTERM, or SIGINT, exits without waiting. A model that cannot load ends the process
with status 1 after its one error line: a supervisor restarts it, a person sees it at once.
With certificate files it speaks https and wss only (uvicorn's TLS); with a CA file as well, it
asks every client for a certificate signed by it and refuses those without.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from streamsd.config import SWITCH_INTERVAL_S
from streamsd.server import access_log
from streamsd.server.app import EngineFactory, create_app
from streamsd.server.origins import OriginPolicy
from streamsd.server.state import ServerState

log = logging.getLogger("streamsd")
WS_MAX_FRAME = 1 << 20


@contextmanager
def short_switch_interval() -> Iterator[None]:
    """Python's thread switch interval set to SWITCH_INTERVAL_S while the server runs, then restored."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@dataclass(frozen=True, slots=True)
class Tls:
    certfile: str
    keyfile: str
    ca_certs: str | None = None  # client certificates required, signed by these

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if self.ca_certs else ssl.CERT_NONE}


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self.state.load_error:
            return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            self.state.draining = True
            log.info("SIGTERM: draining (up to %.0fs)", self.state.drain_timeout)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            return
        # Not recorded as a captured signal: uvicorn would re-raise it and we would exit non-zero.
        self.should_exit = True

    async def _drain(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + self.state.drain_timeout
        while engine and engine.num_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine and engine.num_streams:
            log.info("drain timeout: cancelling %d streams", engine.num_streams)
            engine.abort_all()
            flush = time.monotonic() + 5.0
            while engine.num_streams and time.monotonic() < flush:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the final events reach the sockets
        self.should_exit = True


def serve(state: ServerState, factory: EngineFactory, host: str, port: int, web_dir: Path | None,
          log_level: str = "info", access_log_enabled: bool = True, origins: OriginPolicy = OriginPolicy(),
          tls: Tls | None = None, engine_process: bool = False) -> int:
    app = create_app(state, factory, web_dir, origins, engine_process)
    config = uvicorn.Config(
        app, host=host, port=port, loop="uvloop", http="httptools", ws="websockets-sansio",
        ws_max_size=WS_MAX_FRAME, log_level=log_level, timeout_graceful_shutdown=5,
        access_log=access_log_enabled, lifespan="on", **(tls.uvicorn_options() if tls else {}),
    )
    access_log.install(access_log_enabled, state.api_keys)
    server = DrainingServer(config, state)
    with short_switch_interval():
        server.run()
    return 1 if state.load_error else 0
