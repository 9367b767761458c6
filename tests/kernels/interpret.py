"""The kernel tests' common start, imported before any kernel module: on a CPU the Triton kernels run
under TRITON_INTERPRET=1, which Triton reads when @triton.jit decorates; without triton the importing
test module skips."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
