"""tau on a CPU with kernels/head_topk.py's arithmetic in torch (session 26): each tree level's children ranked
over the int8 rows of the head's lm_head (DraftLogits.dequantized, the kernel's oracle), the head output in
bf16, times the final norm's weight (rounded to bf16 again) or with that weight folded into the int8 rows
(--folded, the first shipped version), its 1/rms applied after the GEMM. Then scripts/bench_eagle.py as usual:

  PYTHONPATH=. python3 docs/issue9-eagle/session26/tau_kernel_math.py [--folded] --model smollm2-135m-instruct \
      --prompts 6 --max-tokens 128 --device cpu --no-hf --methods none --trees 4,6,6,24 --out FILE
"""

import sys

import torch

import streamsd.spec.eagle_tree as et
from streamsd.kernels.head_topk import DraftLogits

FOLDED = "--folded" in sys.argv
rows: dict[int, torch.Tensor] = {}


def children(head, out, c, race, keys, level):
    g = head.norm.weight.detach().float()
    if id(head) not in rows:
        lm = (head.lm_head if hasattr(head, "lm_head") else head.shared.lm_head).weight.detach()
        rows[id(head)] = DraftLogits.build(lm.float() * g if FOLDED else lm, None, 0.0, None).dequantized()
    x = out.to(torch.bfloat16).float()
    xg = x if FOLDED else (x * g).to(torch.bfloat16).float()
    logits = (xg @ rows[id(head)].t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.spec.args.rms_norm_eps)
    if race is not None:
        logits = et.race_logits(logits, race, keys[level])
    return torch.log_softmax(logits, dim=-1).topk(c, dim=-1)


et._children = children
sys.argv = ["bench_eagle.py"] + [a for a in sys.argv[1:] if a != "--folded"]
sys.path.insert(0, "scripts")
import bench_eagle  # noqa: E402

bench_eagle.main()
