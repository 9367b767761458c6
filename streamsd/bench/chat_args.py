"""`streamsd bench chat`'s options, apart from the benchmark (which imports torch) so that `--help` is quick."""

from __future__ import annotations

import argparse

DEFAULT_METHODS = "plain,ngram,eagle"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target: a model name, HF directory or .gguf")
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the one shipped for --model)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--held-out", default=None,
                        help="a training.json whose held-out prompts to use (default: the head's own)")
    source.add_argument("--dataset", default=None,
                        help="prompts never used in training instead: an MT-bench JSONL, a ShareGPT JSON or random[:N]")
    p.add_argument("--prompts", type=int, default=6, help="how many prompts to answer per method and temperature")
    p.add_argument("--max-tokens", type=int, default=128, help="the most tokens an answer gets (most stop at EOS)")
    p.add_argument("--temperatures", default="0,1", help="a comma list of sampling temperatures")
    p.add_argument("--k", type=int, default=4, help="drafts per step of the ngram and EAGLE chains")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (default: cores - 1)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the engines' dtype (float32: no bfloat16 rounding between greedy speculative answers and plain's)")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers' generate")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"a comma list from plain, plain-seq, ngram, eagle (default: {DEFAULT_METHODS}; plain always runs)")
    p.add_argument("--adaptive", action="store_true", help="also the EAGLE chain under the adaptive policy (eagle-ad)")
    p.add_argument("--trees", default=None,
                   help="draft-tree shapes 'D,M,C,N' separated by ';', one engine each (a '/native' suffix ranks "
                        "drafts over the head's lm_head as it is, not an int8 copy)")
    p.add_argument("--exact", action="store_true",
                   help="every engine in the exact mode: speculative answers must equal plain's at every temperature")
    p.add_argument("--output-json", default=None, help="write the figures and every answer here")
