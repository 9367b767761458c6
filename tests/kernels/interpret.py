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

    # The interpreter's tl.dot is NumPy's matmul, whose BLAS kernels block the rows: a row's sums came out
    # in another order (other bits) by its place in the tile, on some CPUs and not others. The exact
    # kernels' tests need what the GPU gives: each element's products added in increasing k, whatever
    # the tile's other rows hold. float32 dots (the only ones these tests run on a CPU) do that here.
    matmul_dot = interp.InterpreterBuilder.create_dot

    def ordered_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return matmul_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.copy()  # [..., M, N]
        for k in range(a.data.shape[-1]):
            acc += a.data[..., :, k:k + 1] * b.data[..., k:k + 1, :]  # [..., M, 1] * [..., 1, N]
        return interp.TensorHandle(acc, d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = ordered_dot


if not CUDA:
    _interpreter_shim()

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
