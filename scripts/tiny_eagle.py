"""The profilers' small random target (8 layers) with an untrained EAGLE-3 head: host and launch costs
do not depend on weights, and it builds in seconds. Imported by profile_eagle.py, host_phases.py and
launch_costs.py (run from the repository root)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from streamsd.engine.builder import load_model  # noqa: E402
from streamsd.spec_decode.eagle.checkpoint import new_head, save_head  # noqa: E402
from tests.tiny import build_model  # noqa: E402


def build_tiny_eagle() -> tuple[Path, Path]:
    """(target directory, head directory) in a fresh temporary directory."""
    work = Path(tempfile.mkdtemp())
    target_dir = build_model(work / "target", layers=8, hidden=256, heads=4, kv_heads=2, intermediate=512,
                             max_pos=4096)
    target = load_model(str(target_dir), torch.device("cpu"), torch.float32)[0]
    head_dir = save_head(new_head(target, kind="eagle3", draft_ids=list(range(target.args.vocab_size))),
                         work / "head", json.loads((target_dir / "config.json").read_text()), torch.float32)
    return target_dir, Path(head_dir)
