"""What the kernel-against-oracle tests share: the dtypes they run (on CUDA natively, bf16/fp16 within
their rounding's relative error of the float64 reference, fp32 tighter; on a CPU tiny float32 shapes
under the interpreter) and the relative error they read."""

from __future__ import annotations

import torch

from tests.kernels.interpret import CUDA

DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())
