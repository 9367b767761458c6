"""Analytic step time: the cost table's fallback before anything is measured, and the simulator's
ground truth: t(B, N) = max(weights / bandwidth, flops(N) / peak) + KV bytes / bandwidth + fixed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RooflineModel:
    """Analytic step time of one model forward over ``num_tokens`` tokens of ``batch_size`` requests."""

    weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: float = 0.0
    context_len: int = 512
    bandwidth: float = 4.25e12
    peak_flops: float = 790e12
    fixed_s: float = 2e-4

    def step_time(self, batch_size: int, num_tokens: int, context_tokens: int | None = None) -> float:
        ctx = batch_size * self.context_len if context_tokens is None else context_tokens
        dense = max(self.weight_bytes / self.bandwidth, self.flops_per_token * num_tokens / self.peak_flops)
        return dense + self.kv_seconds(ctx) + self.fixed_s

    def kv_seconds(self, context_tokens: int) -> float:
        return context_tokens * self.kv_bytes_per_token / self.bandwidth

    @classmethod
    def llama3_8b_h200(cls, context_len: int = 512) -> RooflineModel:
        # bf16 weights; GQA KV = 32 layers × 8 heads × 128 × (k, v) × 2 B; FLOPs incl. attention.
        return cls(16.06e9, 2 * 8.03e9 + 4 * 32 * 4096 * context_len, 131072.0, context_len)

    @classmethod
    def llama32_1b_h200(cls, context_len: int = 512) -> RooflineModel:
        # The draft: 16 layers × 8 heads × 64 × 2 × 2 B of KV per token; lighter launch overhead.
        return cls(2.47e9, 2 * 1.24e9 + 4 * 16 * 2048 * context_len, 32768.0, context_len, fixed_s=1e-4)
