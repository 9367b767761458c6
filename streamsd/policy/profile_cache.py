"""The adaptive policy's start-up cost profile, kept on disk and reused by the next start.

Profiling times the engine's step shapes before the first request: 25-40 s on a 2-core CPU for
SmolLM2, most of a warm start. The table depends only on what runs and where, so it is stored under
``$STREAMSD_HOME/profiles/`` keyed by the model files, the device, the dtype, the CPU threads, the
versions of streamsd and torch and the profile's own parameters (batch and token limits, k, the
proposer, CUDA graphs), and read back by a start with the same key. The policy still corrects the
table online from measured steps, as it does a fresh one; a stale table (the machine got busier) is
corrected the same way.

A file that does not parse, or whose stored key is not the one asked for, is ignored and rewritten;
writes go through a temporary file and a rename, so a crash or a concurrent start never leaves half
a file. ``mode``: ``reuse`` (the default), ``refresh`` (profile again and overwrite) or ``off`` (profile,
write nothing); ``$STREAMSD_PROFILE_CACHE`` sets it where the caller passes none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.adaptive.shape import ShapeTable

MODES = ("reuse", "refresh", "off")
FORMAT = 1  # bump when the stored layout or what profiling measures changes
log = logging.getLogger("streamsd")


def cache_mode(mode: str | None) -> str:
    """``mode``, else ``$STREAMSD_PROFILE_CACHE``, else ``reuse``; a ValueError for anything else."""
    mode = mode or os.environ.get("STREAMSD_PROFILE_CACHE") or "reuse"
    if mode not in MODES:
        raise ValueError(f"the profile cache mode must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def files_fingerprint(paths: list[Path]) -> list[list[Any]]:
    """Name, size and modification time of every file of these model directories (or files): what
    identifies a model's weights without hashing gigabytes."""
    out: list[list[Any]] = []
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for f in files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def load_or_profile(key: Mapping[str, Any], measure: Callable[[], CostTable], *, home: Path,
                    mode: str = "reuse") -> tuple[CostTable, Path | None]:
    """The profile for ``key``: read from the cache when there is a valid one (``mode`` reuse), else
    ``measure()`` and store it (unless ``mode`` is off). Returns (table, file it was read from or None)."""
    full = {"format": FORMAT, **key}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]
    path = home / "profiles" / f"{digest}.json"
    if mode == "reuse":
        table = _read(path, full)
        if table is not None:
            return table, path
    table = measure()
    if mode != "off":
        _write(path, full, table)
    return table, None


def _read(path: Path, key: Mapping[str, Any]) -> CostTable | None:
    try:
        doc = json.loads(path.read_text())
        if doc["key"] != key:
            log.info("the cost profile in %s was made for another set-up; profiling again", path)
            return None
        return table_from_json(doc["table"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable, not JSON, not our layout
        log.warning("ignoring the unreadable cost profile %s (%s); profiling again", path, exc)
        return None


def _write(path: Path, key: Mapping[str, Any], table: CostTable) -> None:
    doc = {"key": dict(key), "table": table_to_json(table)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:  # a read-only cache costs the next start a profile, nothing more
        log.warning("could not save the cost profile to %s (%s)", path, exc)


def table_to_json(t: CostTable) -> dict[str, Any]:
    """What profiling measured (the start-up table; the online corrections are not kept)."""
    step = lambda s: {"keys": list(s.keys), "values": list(s.values)}  # noqa: E731
    shape = t.shape
    return {
        "verify": step(t.verify), "draft": step(t.draft), "catchup": step(t.catchup), "tree": step(t.tree),
        "kv_per_request_s": t.kv_per_request_s, "spec_overhead_s": t.spec_overhead_s,
        "shape": None if shape is None else {"batches": list(shape.batches), "widths": list(shape.widths),
                                             "values": [list(r) for r in shape.values], "padded": shape.padded,
                                             "timed": shape.timed},
    }


def table_from_json(d: Mapping[str, Any]) -> CostTable:
    def step(s: Mapping[str, Any]) -> StepTable:
        keys, values = tuple(int(k) for k in s["keys"]), tuple(float(v) for v in s["values"])
        if len(keys) != len(values):
            raise ValueError("a step table's keys and values differ in length")
        return StepTable(keys, values)

    shape = None
    if d["shape"] is not None:
        s = d["shape"]
        batches, widths = tuple(int(b) for b in s["batches"]), tuple(int(w) for w in s["widths"])
        values = tuple(tuple(float(v) for v in row) for row in s["values"])
        if len(values) != len(batches) or any(len(row) != len(widths) for row in values):
            raise ValueError("the shape table's rows do not match its batches and widths")
        shape = ShapeTable(batches, widths, values, bool(s["padded"]), int(s["timed"]))
    return CostTable(step(d["verify"]), step(d["draft"]), float(d["kv_per_request_s"]), float(d["spec_overhead_s"]),
                     shape=shape, catchup=step(d["catchup"]), tree=step(d["tree"]) if "tree" in d else StepTable())
