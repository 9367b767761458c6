"""`streamsd bench offline`'s options, apart from the benchmark so that `--help` loads no torch."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model path, smollm2-135m-instruct, or a random-weight preset: llama-3.1-8b, llama-3.2-1b")
    p.add_argument("--draft-model", default=None,
                   help="draft model (path or preset) for draft/synthetic; the head directory for eagle")
    p.add_argument("--speculative-method", choices=["none", "draft", "ngram", "eagle", "synthetic"], default=None,
                   help="the speculative cells' method; default: draft with --draft-model, else none (plain only)")
    p.add_argument("--acceptance-rate", default="0.8",
                   help="alpha of the synthetic proposer; a comma list (0.3,0.5,0.7,0.9) gives one synthetic cell "
                        "per alpha and batch size over one plain pass per batch size")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K, the most drafts verified per step")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma list of batch sizes, one row of cells each")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per cell (default: the batch size)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens every request generates (EOS ignored)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens for random-weight presets")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; auto: bfloat16 on CUDA and bf16-capable CPUs, else float32")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (CUDA)")
    p.add_argument("--speculation-policy", choices=["fixed", "adaptive"], default="fixed",
                   help="adaptive: k per request and step from a cost table profiled at start")
    p.add_argument("--forced-plain", action="store_true",
                   help="also run the speculative engine with every request's k capped at 0 (its cost when unused)")
    p.add_argument("--paired-plain", action="store_true",
                   help="run a plain pass beside each speculative cell's measured pass and compare with it "
                        "(cancels the machine's drift between passes; plain_drift says how large it was)")
    p.add_argument("--pairs", type=int, default=1,
                   help="with --paired-plain: (plain, measured) pairs per cell, the plain pass first in every "
                        "other pair; the cell reports the median pair and every pair's ratios")
    p.add_argument("--unpipelined-plain", action="store_true",
                   help="also run each plain pass without queueing the next plain step before reading this one "
                        "(method plain-unpipelined: the gain of the pipelined step, side by side)")
    p.add_argument("--exact", action="store_true",
                   help="the engine in exact mode (a batch-invariant target forward): run with and without it to "
                        "price it")
    p.add_argument("--check-identical", action="store_true",
                   help="exit 1 unless every plain pass gives the smallest batch's tokens for the same prompts and "
                        "every speculative pass its batch's plain tokens (expected with --exact)")
    p.add_argument("--output-json", default=None, help="write the cells as JSON here (after every batch size)")
    p.add_argument("--plot", default=None, help="write a PNG of the cells")
