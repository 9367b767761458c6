"""OpenAI's `system_fingerprint`: which backend configuration produced an answer.

The same streamsd version serving the same weights the same way gives the same fingerprint on every
start; a change that can change outputs (another version, model, draft, dtype, device, speculation
settings) gives another. What varies between starts without changing outputs (the KV pool's size,
which depends on free memory) is left out.
"""

from __future__ import annotations

import hashlib

from streamsd import __version__
from streamsd.engine.info import EngineInfo


def system_fingerprint(info: EngineInfo, served_model_name: str) -> str:
    parts = [__version__, served_model_name, str(info.model_dir), info.model, repr(info.spec), info.device_type,
             f"torch.{info.cache_dtype}", repr(info.generation_defaults)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:10]
    return f"fp_streamsd-{__version__}-{digest}"
