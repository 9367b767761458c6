"""Plain steps' sampling over a top-k/top-p cut as CUDA graphs (sample/cut_graphs.py): the tokens the
eager `sample_keyed` draws, from the same logits and parameters, whatever the batch's bucket."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.request import Request
from streamsd.sample.cut_graphs import CutSampling
from streamsd.sample.sampler import sample_keyed
from streamsd.sample.warp import WarpParams
from tests.engine.engine_helpers import PROMPTS, assert_free

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PARAMS = [  # (temperature, top_k, top_p, min_p): greedy, cut by top-p, by top-k, by both, min-p beside
    (0.0, 0, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 20, 0.8, 0.05), (1.0, 0, 0.95, 0.1),
]


def _requests(n: int) -> list[Request]:
    reqs = []
    for i in range(n):
        t, k, p, m = PARAMS[(i + 1) % len(PARAMS)]  # the greedy row fifth
        sp = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=8)
        reqs.append(Request(f"r{i}", [1, 2, 3], sp, seed=1000 + i, arrival=0.0))
    return reqs


@pytest.mark.parametrize("n", [1, 3, 5, 8, 13])
def test_cut_graphs_draw_the_eager_paths_tokens(n):
    """Every bucket up to 16 captured; a batch of n rows (padded to its bucket) against sample_keyed on
    the same rows, over many positions (each a fresh draw of the keyed noise)."""
    dev = torch.device("cuda")
    vocab = 4099
    cut = CutSampling(vocab, dev)
    assert cut.capture([1, 2, 4, 8, 16]) == 5 and cut.capture([1, 2, 4]) == 0
    reqs = _requests(n)
    assert cut.serves(reqs)
    wp = WarpParams.build([(r.params.temperature, r.params.top_k, r.params.top_p, r.params.min_p) for r in reqs], dev)
    g = torch.Generator(device=dev).manual_seed(n)
    differing = 0
    for step in range(40):
        logits = torch.randn(n, vocab, device=dev, generator=g) * 4.0  # [n, V]
        positions = [17 + step + i for i in range(n)]
        ints = torch.tensor([[r.params.greedy for r in reqs], [r.seed for r in reqs], positions], dtype=torch.int64,
                            device=dev)  # [3, n]
        want = sample_keyed(logits, wp, ints)
        got = cut.sample(reqs, logits, positions)
        differing += int((got != want).sum())
    assert differing == 0
    assert cut.replays == 40


def test_a_sampled_plain_engine_replays_cut_graphs_and_draws_what_eager_sampling_draws(tiny_model_dir):
    """Seeded top-p requests through a CUDA engine: the same answers with the cut graphs and with its
    verifier's eager sampling; the graphs replayed; nothing held after."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=k, max_tokens=24, seed=i, ignore_eos=True)
              for i, k in enumerate((0, 0, 30, 0))]
    answers = []
    for graphs in (True, False):
        llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=4096)
        verifier = llm.core.rt.worker.verifier
        assert verifier.cut is not None and verifier.cut.graphs
        if not graphs:
            verifier.cut = None  # the same engine, its eager sampling
        answers.append([r.outputs[0].token_ids for r in llm.generate(PROMPTS[:4], params)])
        if graphs:
            assert verifier.cut is not None and verifier.cut.replays > 10
        assert_free(llm)
    assert answers[0] == answers[1]
