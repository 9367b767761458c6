"""The kernel tests' common start, imported before any kernel module: on a CPU the Triton kernels run
under TRITON_INTERPRET=1, which Triton reads when @triton.jit decorates (with an interpreter that accepts
NumPy 2's scalars); without triton the importing test module skips."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed")


def _interpreter_shim() -> None:
    """triton 3.6's interpreter loads scalars as 1-element arrays and int()s them for loop bounds,
    which NumPy 2 refuses; give its module an int() that accepts them. Test-only, CPU-only."""
    import builtins

    import numpy as np
    import triton.runtime.interpreter as interp

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, builtins.int)

    class _Int(builtins.int, metaclass=_Meta):
        def __new__(cls, x=0, *base):
            if isinstance(x, np.ndarray) and x.size == 1:
                x = x.reshape(())
            return builtins.int(x, *base)

    interp.int = _Int


if not CUDA:
    _interpreter_shim()

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
