"""Bookkeeping for `bench soak`: the shared run context, the running tally, the drain check and
the final frozen report."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from streamsd.bench.client import RequestResult
from streamsd.bench.metrics_scrape import scrape

MAX_SAMPLES = 12  # problem descriptions kept for the report; counts are always complete


@dataclass(frozen=True)
class Context:
    client: aiohttp.ClientSession
    base_url: str
    headers: dict[str, str]
    model: str
    answers: tuple[str, ...]
    max_tokens: int
    seed: int
    deadline: float
    max_requests: int
    request_timeout: float
    disconnect_rate: float
    bad_input_rate: float
    websocket_share: float
    spec_off_share: float


@dataclass(frozen=True)
class DrainState:
    running: float | None
    waiting: float | None
    kv_usage: float | None
    drained: bool
    healthy: bool
    waited_s: float


@dataclass(frozen=True)
class SoakReport:
    model: str
    clients: int
    duration_s: float
    load_s: float
    requests_started: int
    transports: dict[str, int]
    completed: int
    cancelled: int
    disconnects: int
    lost: int
    lost_by_kind: dict[str, int]
    garbled: int
    errors_by_status: dict[str, int]
    expected_errors: int
    unexpected_errors: int
    load_shed: int
    problems: tuple[str, ...]
    final: DrainState
    passed: bool


@dataclass
class Tally:
    """Counts shared by every client loop; all updates happen on the one event loop thread."""

    started: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnects: int = 0
    lost: int = 0
    garbled: int = 0
    expected_errors: int = 0
    unexpected_errors: int = 0
    load_shed: int = 0
    transports: Counter[str] = field(default_factory=Counter)
    lost_by_kind: Counter[str] = field(default_factory=Counter)
    errors_by_status: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.problems) < MAX_SAMPLES:
            self.problems.append(text)

    def record(self, result: RequestResult, answer: str, speculative: bool | None) -> None:
        """Classify a valid request's result; a partial stream must be a prefix of the answer."""
        where = f"spec={'off' if speculative is False else 'default'}"
        if result.outcome == "completed":
            if result.text == answer:
                self.completed += 1
            else:
                self.garbled += 1
                self.note(f"garbled ({where}): expected {answer!r}, got {result.text!r}")
        elif result.outcome in ("cancelled", "disconnected"):
            if result.outcome == "cancelled":
                self.cancelled += 1
            else:
                self.disconnects += 1
            if not answer.startswith(result.text):
                self.garbled += 1
                self.note(f"garbled partial ({where}): {result.text!r} is not a prefix of {answer!r}")
        elif result.outcome == "error":
            kind = result.error_kind or "error"
            self.errors_by_status[kind] += 1
            if kind == "429":  # queue full: load shedding is allowed under overload
                self.load_shed += 1
            else:
                self.unexpected_errors += 1
                self.note(f"valid request refused ({kind}): {result.message}")
        else:
            self.lost += 1
            self.lost_by_kind[result.error_kind or "lost"] += 1
            self.note(f"lost ({result.error_kind}, {where}) after {len(result.text)} chars: {result.message}")

    def bad_input_answer(self, status: str, expected: bool, name: str) -> None:
        self.errors_by_status[status] += 1
        if expected:
            self.expected_errors += 1
        else:
            self.unexpected_errors += 1
            self.note(f"malformed request {name} answered {status}")

    def unexpected_error(self, kind: str, message: str) -> None:
        self.errors_by_status[kind] += 1
        self.unexpected_errors += 1
        self.note(f"{kind}: {message}")

    def report(self, args: argparse.Namespace, model: str, load_s: float, final: DrainState) -> SoakReport:
        passed = (self.lost == 0 and self.garbled == 0 and self.unexpected_errors == 0
                  and final.drained and final.healthy)
        return SoakReport(
            model=model, clients=args.clients, duration_s=args.duration, load_s=load_s,
            requests_started=self.started, transports=dict(self.transports), completed=self.completed,
            cancelled=self.cancelled, disconnects=self.disconnects, lost=self.lost,
            lost_by_kind=dict(self.lost_by_kind), garbled=self.garbled,
            errors_by_status=dict(sorted(self.errors_by_status.items())),
            expected_errors=self.expected_errors, unexpected_errors=self.unexpected_errors,
            load_shed=self.load_shed, problems=tuple(self.problems), final=final, passed=passed,
        )


async def drain(client: aiohttp.ClientSession, base_url: str, headers: dict[str, str], timeout: float) -> DrainState:
    """Poll /metrics until nothing runs or waits and the KV cache is empty, or `timeout` passes."""
    start = time.monotonic()
    running = waiting = kv = None
    while True:
        snap = await scrape(client, base_url, headers)
        if snap is not None:
            running = snap.get("num_requests_running")
            waiting = snap.get("num_requests_waiting")
            kv = snap.get("kv_cache_usage_perc")
        idle = running == 0 and kv == 0 and not waiting
        if idle or time.monotonic() - start > timeout:
            break
        await asyncio.sleep(0.25)
    try:
        async with client.get(base_url.rstrip("/") + "/health") as resp:
            healthy = resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        healthy = False
    return DrainState(running, waiting, kv, idle, healthy, time.monotonic() - start)


def _counts(counter: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counter.items()) or "-"


def report_rows(r: SoakReport) -> list[tuple[str, str]]:
    def num(v: float | None) -> str:
        return "n/a" if v is None else f"{v:g}"

    rows = [
        ("load time (s)", f"{r.load_s:.1f}"),
        ("requests started", str(r.requests_started)),
        ("by transport", _counts(r.transports)),
        ("streams completed (text == known answer)", str(r.completed)),
        ("streams cancelled over WS", str(r.cancelled)),
        ("disconnects done", str(r.disconnects)),
        ("streams lost", f"{r.lost}" + (f" ({_counts(r.lost_by_kind)})" if r.lost else "")),
        ("streams garbled", str(r.garbled)),
        ("error responses by status", _counts(r.errors_by_status)),
        ("expected errors (malformed input refused)", str(r.expected_errors)),
        ("unexpected errors", str(r.unexpected_errors)),
        ("load shed (429)", str(r.load_shed)),
        ("final running requests", num(r.final.running)),
        ("final waiting requests", num(r.final.waiting)),
        ("final KV cache usage", num(r.final.kv_usage)),
        ("drained within timeout", f"{r.final.drained} ({r.final.waited_s:.1f} s)"),
        ("/health after", "200" if r.final.healthy else "not ok"),
        ("verdict", "PASS" if r.passed else "FAIL"),
    ]
    rows += [(f"problem {i + 1}", p) for i, p in enumerate(r.problems)]
    return rows
