"""OpenAI's `system_fingerprint`: which backend configuration produced an answer.

The same streamsd version serving the same weights the same way gives the same fingerprint on every
start; a change that can change outputs (another version, model, draft, dtype, device, speculation
settings) gives another. What varies between starts without changing outputs (the KV pool's size,
which depends on free memory) is left out.
"""

from __future__ import annotations

import hashlib

from streamsd import __version__
from streamsd.engine.core import EngineCore


def system_fingerprint(core: EngineCore, served_model_name: str) -> str:
    model = core.rt.args  # its repr leaves the raw config out
    parts = [__version__, served_model_name, str(core.rt.model_dir), repr(model), repr(core.spec),
             core.rt.worker.device.type, str(core.rt.worker.cache.data.dtype), repr(core.rt.generation_defaults)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]
    return f"fp_streamsd-{__version__}-{digest}"
