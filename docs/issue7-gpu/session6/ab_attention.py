"""A/B on a GPU: the attention kernels before and after the attend_tile refactor, 8B shapes, CUDA events.

Reproduce (repo root, on the H200, carrying .scratch):
  mkdir -p .scratch && git show 0b1360d:streamsd/kernels/paged_attention.py > .scratch/old_paged.py
  git show 0b1360d:streamsd/kernels/prefill_attention.py > .scratch/old_prefill.py
  sed -i 's/from streamsd.kernels.prefill_attention import/from old_prefill import/' .scratch/old_paged.py
  PYTHONPATH=. python3 docs/issue7-gpu/session6/ab_attention.py
"""

import sys

import torch

sys.path.insert(0, ".scratch")
import old_paged  # noqa: E402
import old_prefill  # noqa: E402

from streamsd.kernels import paged_attention as new_paged  # noqa: E402
from streamsd.kernels import prefill_attention as new_prefill  # noqa: E402

H, KVH, D, PAGE = 32, 8, 128, 16
SCALE = D**-0.5


def bench(fn, iters=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(5):
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) / iters * 1000)
    return min(best)


def paged_case(dev, batch, ctx, qlen):
    nblk = -(-ctx // PAGE)
    kc = torch.randn(batch * nblk + 1, PAGE, KVH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.arange(batch * nblk, device=dev, dtype=torch.int32).view(batch, nblk)
    cl = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    qs = torch.arange(0, (batch + 1) * qlen, qlen, device=dev, dtype=torch.int32)
    q = torch.randn(batch * qlen, H, D, device=dev, dtype=torch.bfloat16)

    def run(mod):
        return mod.paged_attention(q, kc, vc, bt, cl, qs, SCALE, qlen)

    err = (run(old_paged).float() - run(new_paged).float()).abs().max().item()
    t_old, t_new = bench(lambda: run(old_paged)), bench(lambda: run(new_paged))
    print(f"decode B={batch:4d} ctx={ctx} q={qlen}: old {t_old:8.1f} us  new {t_new:8.1f} us  "
          f"new/old {t_new / t_old:.3f}  maxdiff {err:.2e}")


def prefill_case(dev, seqs, length):
    nblk = -(-length // PAGE)
    kc = torch.randn(seqs * nblk + 1, PAGE, KVH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.arange(seqs * nblk, device=dev, dtype=torch.int32).view(seqs, nblk)
    q = torch.randn(seqs * length, H, D, device=dev, dtype=torch.bfloat16)
    tiles = new_prefill.prefill_tiles([i * length for i in range(seqs)], [length] * seqs, [length] * seqs, 16,
                                      new_prefill.tokens_per_tile(H, KVH))
    out = torch.empty_like(q)

    def run(mod, o):
        return mod.prefill_attention(q, kc, vc, bt, tiles, SCALE, o)

    err = (run(old_prefill, torch.empty_like(q)).float() - run(new_prefill, torch.empty_like(q)).float()).abs().max()
    t_old, t_new = bench(lambda: run(old_prefill, out), 20), bench(lambda: run(new_prefill, out), 20)
    print(f"prefill S={seqs} L={length}: old {t_old:8.1f} us  new {t_new:8.1f} us  new/old {t_new / t_old:.3f}  "
          f"maxdiff {err.item():.2e}")


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for batch, ctx, qlen in [(1, 640, 1), (16, 640, 1), (64, 640, 1), (64, 640, 5), (256, 640, 1), (1, 4096, 5)]:
        paged_case(dev, batch, ctx, qlen)
    for seqs, length in [(16, 512), (4, 2048)]:
        prefill_case(dev, seqs, length)


if __name__ == "__main__":
    main()
