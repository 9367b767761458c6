"""Structured output: a request's grammar (JSON, a JSON schema, a regex) as a mask on the target's p.

The grammar engine is xgrammar. Its matcher follows one request's output token by token and says, as
a bitmask over the vocabulary, which tokens may come next; EOS is allowed exactly when the structure
may end, so the grammar, not the model, decides when a constrained answer is complete.

**Exact under speculation.** The mask is part of the target distribution, like a logit bias: forbidden
tokens get logit -inf before warping (verify.adjust_rows), so p is the grammar-constrained p at every
row. Row j of a verify window decides the token after drafts 0..j-1, so its mask is the matcher's
state after those drafts: the matcher accepts them one by one between masks and rolls them back
afterwards (xgrammar's rollback), and only the tokens a step emits advance it for good. Rejection
sampling against these rows keeps the output distribution that of plain constrained sampling,
whatever the drafter proposed; a greedy row takes the argmax of its masked logits, so speculative
greedy output is plain greedy output. Drafts are cut at the first token the grammar forbids
(`Matcher.allowed`), so no verify row is spent on a draft that p would reject with certainty.

All of it runs on the worker thread, inside the step (compilation too, or on a thread of the server's
pool when a request is admitted): never on the event loop.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

import numpy as np
import torch

from streamsd.config import helper_threads
from streamsd.model.kv_cache import h2d
from streamsd.model.tokenizer import Tokenizer
from streamsd.request import Constraint, ParamError
from streamsd.sched.plan import Scheduled

# Compiled grammars are cached by the engine's compiler, keyed by their schema or regex, up to this size.
CACHE_BYTES = 64 << 20
# xgrammar prefixes its errors with a timestamp and a source location: not the client's business.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


class Grammars:
    """Compiles constraints for one tokenizer; thread-safe. The grammar engine, transformers' tokenizer
    it reads the vocabulary from and the table of token bytes are loaded on the first compilation
    (seconds, once), not at startup."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._batch: Any = None
        self._lock = threading.Lock()

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of `c` (cached); a ParamError naming `c.param` if it cannot compile."""
        compiler = self._get_compiler()
        try:
            if c.kind == "regex":
                return compiler.compile_regex(c.source)
            return compiler.compile_json_schema(c.source, any_whitespace=False)
        except RuntimeError as exc:
            message = _LOCATION.sub("", str(exc).strip()).strip()
            raise ParamError(c.param, f"cannot be compiled: {message}") from None

    def matcher(self, c: Constraint, eos_ids: frozenset[int]) -> Matcher:
        return Matcher(self, c, sorted(eos_ids))

    def batch(self) -> Any:
        """xgrammar's batch matcher: fills many matchers' masks at once on a few threads of its own."""
        with self._lock:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(max_threads=helper_threads(os.cpu_count()))
            return self._batch

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.transformers(), vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
            return self._compiler


class Matcher:
    """One request's grammar state, kept at its output so far: it catches up with the tokens the
    request gained since the last step when it is next used (always on the worker thread)."""

    def __init__(self, grammars: Grammars, c: Constraint, stop_ids: list[int]):
        self.grammars = grammars
        self.constraint = c
        self.stop_ids = stop_ids
        self.words = (grammars.vocab_size + 31) // 32
        self._m: Any = None
        self._consumed = 0

    def _at(self, output_ids: list[int]) -> Any:
        if self._m is None:
            import xgrammar as xgr

            self._m = xgr.GrammarMatcher(self.grammars.compile(self.constraint), override_stop_tokens=self.stop_ids)
        for t in output_ids[self._consumed :]:
            if self._m.is_terminated():
                break  # past a stop token: the request ends there
            ok = self._m.accept_token(t)
            assert ok, f"token {t} was emitted against the request's grammar"
        self._consumed = len(output_ids)
        return self._m

    def allowed(self, output_ids: list[int], tokens: list[int]) -> int:
        """How many of `tokens`, in order after `output_ids`, the grammar allows before the first it forbids."""
        m = self._at(output_ids)
        n = 0
        for t in tokens:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def masks(self, output_ids: list[int], drafts: list[int], rows: int) -> np.ndarray:
        """[rows, words] int32 bitmasks: row j allows the tokens that may follow `output_ids` and
        drafts 0..j-1. Rows past a forbidden draft repeat the last mask: the draft is rejected for
        certain (p gives it 0), so nothing reads them. A row after a stop token allows everything:
        the request ends at the stop, and its bonus row, never emitted, must still be a distribution."""
        return _fill_rows([self._at(output_ids)], [drafts], rows, self.words, self.grammars.batch())[0]


def apply_masks(entries: list[Scheduled], rows: torch.Tensor, pick: list[int]) -> torch.Tensor:
    """rows [B, W, V]: the entries `pick` (constrained requests) get -inf at every token their grammar
    forbids at each row (a new tensor); the others are left as they are. The bits are applied by
    xgrammar's kernel (C++ on the CPU, its own on CUDA): a third of what unpacking them in torch costs."""
    import xgrammar as xgr

    width, vocab = rows.shape[1], rows.shape[2]
    packed = batch_masks(entries, pick, width)  # [P, W, words]
    bits = h2d(torch.from_numpy(packed.reshape(len(pick) * width, -1)), torch.int32, rows.device)  # [P * W, words]
    index = h2d(pick, torch.int64, rows.device)  # [P]
    sub = rows.index_select(0, index).reshape(len(pick) * width, vocab).float()  # [P * W, V], a copy
    xgr.apply_token_bitmask_inplace(sub, bits, vocab_size=vocab)
    return rows.index_copy(0, index, sub.view(len(pick), width, vocab).to(rows.dtype))  # [B, W, V], a new tensor


def batch_masks(entries: list[Scheduled], pick: list[int], width: int) -> np.ndarray:
    """[P, W, words] int32: entry pick[p]'s rows as its `Matcher.masks` gives them for its drafts (rows
    past them, padding nobody reads, repeat its last)."""
    matchers = [entries[b].request.matcher for b in pick]
    states = [mt._at(entries[b].request.output_ids) for b, mt in zip(pick, matchers, strict=True)]
    drafts = [entries[b].request.draft_ids[: entries[b].num_drafts] for b in pick]
    return _fill_rows(states, drafts, width, matchers[0].words, matchers[0].grammars.batch())


def _fill_rows(states: list[Any], drafts: list[list[int]], width: int, words: int, batch: Any) -> np.ndarray:
    """[P, W, words]: `Matcher.masks`'s rows for each xgrammar matcher state (at its output) and its drafts.
    Row j of every request is filled in one call on the batch matcher's threads: 64 requests verifying 4
    drafts each want 320 masks a step, which one Python loop over the requests would fill one after
    another on the step's critical path. The drafts are accepted between rows and rolled back after."""
    used = [min(width, len(d) + 1) for d in drafts]  # rows each request reads
    out = np.zeros((len(states), width, words), dtype=np.int32)  # [P, W, words]
    flat = torch.from_numpy(out.reshape(len(states) * width, words))  # [P * W, words], the same memory
    taken = [0] * len(states)
    for j in range(width):
        fill, at = [], []
        for p, m in enumerate(states):
            if j >= used[p] or taken[p] < j:  # padding, or after a refused draft: p gives it 0, never read
                out[p, j] = out[p, j - 1]
            elif m.is_terminated():
                out[p, j] = -1  # after a stop: the bonus row must still be a distribution
            else:
                fill.append(m)
                at.append(p * width + j)
        if fill:
            batch.batch_fill_next_token_bitmask(fill, flat, at)
        for p, m in enumerate(states):
            if taken[p] == j < len(drafts[p]) and not m.is_terminated() and m.accept_token(drafts[p][j]):
                taken[p] += 1
    for m, n in zip(states, taken, strict=True):
        if n:
            m.rollback(n)
    return out
