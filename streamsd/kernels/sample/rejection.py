"""The rejection sampler in one Triton launch: one program per row, same numbers as the reference.

`streamsd.sample.rejection.rejection_sample` (torch) is the oracle: given the same VerifyInput
(the same uniforms and Exp(1) noise) this kernel makes the same accept decisions and emits the same
tokens. Given seeds and positions instead, it makes those numbers itself, as kernels/sample/rng.py does (the
uniforms bit for bit; the noise as -log rounds on the GPU): no noise tensor of B x (K+1) x V floats
written and read back, two launches fewer a sampled step. It scans the K accept tests first (scalars), then reads the vocabulary once, and only at
the one position that needs a sample: the first rejected draft (recovered token from
norm(max(p - q, 0))) or the bonus position (from p). The reference builds the residual at all
K + 1 positions; the kernel's single pass computes the residual race and the plain-p race together
and picks the second only when the residual is empty, the reference's fallback. Divisions are
round-to-nearest (div_rn) and ties go to the lowest index, as torch's argmax does.

`rejection_sample` here and in sample/rejection.py: tests/kernels/test_sample_kernels.py
`test_rejection_kernel_matches_reference` and `test_rejection_kernel_draws_its_own_keyed_numbers`
compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamsd.kernels.sample.rng import _mix, _row_key, _to_unit, _u32
from streamsd.sample import rng
from streamsd.sample.rejection import VerifyInput


# Per-request rows (draft ids, draft counts, the uniforms' stand-in) arrive as slices of one packed
# int64 buffer, 16-byte aligned or not by the batch size's parity: one binary for both. The other
# per-row pointers are listed too — they are single loads or stores per program either way.
@triton.jit(do_not_specialize_on_alignment=["argmax_ptr", "draft_ptr", "dense_ptr", "ndraft_ptr", "greedy_ptr",
                                            "u_ptr", "tokens_ptr", "accepted_ptr", "seed_ptr", "pos_ptr"],
            do_not_specialize=["accept_stream", "target_stream"])
def _rejection_kernel(
    p_ptr, argmax_ptr, draft_ptr, q_ptr, dense_ptr, ndraft_ptr, greedy_ptr, u_ptr, noise_ptr,
    seed_ptr, pos_ptr, accept_stream, target_stream, tokens_ptr, accepted_ptr, vocab,
    K: tl.constexpr, HAS_P: tl.constexpr, HAS_Q: tl.constexpr, HASH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n_drafts = tl.load(ndraft_ptr + b)
    greedy = tl.load(greedy_ptr + b) != 0
    seed = 0
    if HASH:  # the keyed uniforms and noise made here, as kernels/sample/rng.py makes them
        seed = tl.load(seed_ptr + b)
    dense = False
    if HAS_Q:
        dense = tl.load(dense_ptr + b) != 0
    # -- accept tests, left to right: n = length of the accepted prefix
    n = n_drafts * 0
    going = n_drafts >= 0
    for j in tl.static_range(K):
        d = tl.maximum(tl.load(draft_ptr + b * K + j), 0)
        ok = d == tl.load(argmax_ptr + b * (K + 1) + j)
        if HAS_P:
            p_d = tl.load(p_ptr + (b * (K + 1) + j) * vocab + d)
            q_d = 1.0
            if HAS_Q:
                q_d = tl.where(dense, tl.load(q_ptr + (b * K + j) * vocab + d), 1.0)
            if HASH:
                key = _row_key(seed, tl.load(pos_ptr + b * (K + 1) + j), accept_stream)
                u = _to_unit(_mix(key ^ tl.full([], 0x5F356495, tl.uint32)))
            else:
                u = tl.load(u_ptr + b * K + j)
            ok_random = u * q_d <= p_d
            ok = tl.where(greedy, ok, ok_random)
        going = going & ok & (j < n_drafts)
        n += going.to(n.dtype)
    # -- the token at position n: the target's argmax (greedy), else a race over the vocabulary
    corrected = tl.load(argmax_ptr + b * (K + 1) + n)
    if HAS_P:
        if not greedy:
            row = b * (K + 1) + n
            tested = n < n_drafts  # a live draft was rejected here, so q takes part in the residual
            d_n = tl.maximum(tl.load(draft_ptr + b * K + n, mask=n < K, other=0), 0)
            best_r = tl.full([], -1.0, tl.float32)
            best_r_i = n * 0
            best_p = tl.full([], -1.0, tl.float32)
            best_p_i = n * 0
            any_r = n < 0
            noise_key = tl.full([], 0, tl.uint32)
            if HASH:
                noise_key = _row_key(seed, tl.load(pos_ptr + row), target_stream)
            for v0 in range(0, vocab, BLOCK_V):
                idx = v0 + tl.arange(0, BLOCK_V)
                m = idx < vocab
                p = tl.load(p_ptr + row * vocab + idx, mask=m, other=0.0)
                if HASH:
                    e = -tl.log(_to_unit(_mix(noise_key ^ _u32(idx.to(tl.int64) * 0x61C88647))))
                else:
                    e = tl.load(noise_ptr + row * vocab + idx, mask=m, other=1.0)
                q = tl.where((idx == d_n) & tested, 1.0, 0.0)
                if HAS_Q:
                    # the scalar condition folded into the bound (see kernels/attention/paged.py's _merge_splits_kernel)
                    qd = tl.load(q_ptr + (b * K + n) * vocab + idx, mask=idx < tl.where(tested & dense, vocab, 0),
                                 other=0.0)
                    q = tl.where(dense, qd, q)
                r = tl.maximum(p - q, 0.0)
                any_r = any_r | (tl.max(r, 0) > 0)
                # NaN (a row of garbage, an overflowed model) ranks last: it loses every comparison, so an argmax
                # over it may land past the vocabulary, which the next step would embed
                rr = tl.where(m, tl.math.div_rn(r, e), -1.0)
                rr = tl.where(rr == rr, rr, -1.0)
                pp = tl.where(m, tl.math.div_rn(p, e), -1.0)
                pp = tl.where(pp == pp, pp, -1.0)
                c_r = tl.max(rr, 0)
                c_p = tl.max(pp, 0)
                i_r = tl.argmax(rr, 0) + v0
                i_p = tl.argmax(pp, 0) + v0
                best_r_i = tl.where(c_r > best_r, i_r, best_r_i)
                best_r = tl.maximum(c_r, best_r)
                best_p_i = tl.where(c_p > best_p, i_p, best_p_i)
                best_p = tl.maximum(c_p, best_p)
            corrected = tl.where(any_r, best_r_i, best_p_i)
    for j in tl.static_range(K + 1):
        if j < K:
            tok = tl.where(j < n, tl.load(draft_ptr + b * K + j), tl.where(j == n, corrected, -1))
        else:
            tok = tl.where(j == n, corrected, -1)
        tl.store(tokens_ptr + b * (K + 1) + j, tok.to(tl.int64))
    tl.store(accepted_ptr + b, n.to(tl.int64))


def rejection_sample(v: VerifyInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference: (tokens [B, K+1] with -1 after the last emitted, accepted [B])."""
    batch, k1 = v.target_argmax.shape
    k = k1 - 1
    dev = v.target_argmax.device
    tokens = torch.empty(batch, k1, dtype=torch.int64, device=dev)  # [B, K+1]
    accepted = torch.empty(batch, dtype=torch.int64, device=dev)  # [B]
    if batch == 0:
        return tokens, accepted
    hashed = v.noise is None and v.seeds is not None and v.positions is not None
    has_p = v.target_probs is not None and (v.noise is not None or hashed)
    has_q = has_p and v.draft_probs is not None and k > 0
    # Where a flag leaves an input unread, the kernel still gets a tensor to point at.
    p = noise = q = tokens
    if has_p:
        assert v.target_probs is not None
        p = v.target_probs.float().contiguous()  # [B, K+1, V]
        if not hashed:
            assert v.noise is not None  # has_p: noise, or its keys (hashed)
            noise = v.noise.float().contiguous()  # [B, K+1, V]
    if has_q:
        assert v.draft_probs is not None
        q = v.draft_probs.float().contiguous()  # [B, K, V]
    vocab = p.shape[-1] if has_p else 1
    # K == 0 still needs a [B, 1] draft tensor to point at; it is never read.
    draft = v.draft_ids.contiguous() if k > 0 else torch.zeros(batch, 1, dtype=torch.int64, device=dev)
    uniforms = seeds = positions = draft
    if k > 0 and has_p and not hashed:  # sampled rows only
        assert v.uniforms is not None  # given with the noise
        uniforms = v.uniforms.float().contiguous()
    if hashed:
        assert v.seeds is not None and v.positions is not None
        seeds = v.seeds.contiguous()  # [B]
        positions = v.positions.contiguous()  # [B, K+1]
    # The kernel indexes raw pointers: every input contiguous (views of a packed buffer arrive strided).
    _rejection_kernel[(batch,)](
        p, v.target_argmax.contiguous(), draft, q, v.dense_q.contiguous(), v.num_drafts.contiguous(),
        v.greedy.contiguous(), uniforms, noise, seeds, positions, rng.ACCEPT, rng.TARGET,
        tokens, accepted, vocab,
        K=k, HAS_P=has_p, HAS_Q=has_q, HASH=hashed and has_p,
        BLOCK_V=min(4096, triton.next_power_of_2(max(vocab, 16))), num_warps=8 if has_p else 1,
    )
    return tokens, accepted
