"""Logit bias and repetition/frequency/presence penalties (sample/penalties.py): their definitions, HF's
processors as the oracle, per-position counting of a verify window's drafts, and the rejection
sampler's output against the penalised target distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from streamsd.request import Request, SamplingParams
from streamsd.sample import rng
from streamsd.sample.penalties import penalise
from streamsd.sample.rejection import VerifyInput, rejection_sample
from streamsd.sample.warp import WarpParams, warp
from streamsd.sched.plan import Scheduled
from tests.sample.test_rejection import chi_square_p

V = 12
K = 2


def _entry(prompt: list[int], output: list[int], drafts: list[int], **params) -> Scheduled:
    r = Request("r", prompt, SamplingParams(**params), seed=0, arrival=0.0, output_ids=list(output),
                draft_ids=list(drafts))
    return Scheduled(r, r.num_tokens - 1, 1, len(drafts), 0)


def penalised_reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row, element by element, as vLLM defines it: bias, repetition over prompt + output,
    frequency and presence over the output."""
    x = logits.clone().double()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x.float()


def test_each_row_of_a_window_counts_the_drafts_before_it_as_output():
    g = torch.Generator().manual_seed(0)
    prompt, output, drafts = [1, 2, 2, 3], [4, 5, 5], [5, 6, 1]
    params = dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4, logit_bias={6: 3.0, 9: -100.0})
    rows = torch.randn(1, 4, V, generator=g) * 3  # [B, K+1, V]
    e = _entry(prompt, output, drafts, **params)
    got = penalise([e], rows)
    for j in range(4):
        want = penalised_reference(rows[0, j], prompt, output + drafts[:j], e.request.params)
        assert torch.allclose(got[0, j], want, atol=1e-5), j
    # A request without penalties is left alone, in the same tensor.
    plain = _entry(prompt, output, drafts)
    assert penalise([plain], rows) is rows
    mixed = penalise([plain, e], torch.cat([rows, rows]))
    assert torch.equal(mixed[0], rows[0]) and torch.equal(mixed[1], got[0])


def test_tree_rows_count_the_drafts_on_their_own_path():
    from streamsd.sample.tree_verify import host_tree

    g = torch.Generator().manual_seed(1)
    # root -> node 0 (token 7) -> node 2 (token 8); root -> node 1 (token 9)
    parents, drafts = [-1, -1, 0], [7, 9, 8]
    e = _entry([1, 2], [3], drafts, frequency_penalty=1.5)
    rows = torch.randn(1, 4, V, generator=g)
    _, bits = host_tree(parents)
    got = penalise([e], rows, [bits])
    paths = [[], [7], [9], [7, 8]]  # window row -> the drafts generated before the token it decides
    for j, path in enumerate(paths):
        assert torch.allclose(got[0, j], penalised_reference(rows[0, j], [1, 2], [3] + path, e.request.params), atol=1e-5)


@pytest.mark.parametrize("penalty", [0.7, 1.0, 1.3, 2.0])
def test_repetition_penalty_and_bias_equal_hf_processors_bit_for_bit(penalty):
    g = torch.Generator().manual_seed(2)
    prompt, output = [1, 4, 4, 7, 0], [3, 4, 11]
    logits = torch.randn(1, V, generator=g) * 4  # [1, V]
    bias = {2: 5.0, 4: -1.5, 11: 0.25}
    hf = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([prompt + output]), logits)
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), hf)
    got = penalise([_entry(prompt, output, [], repetition_penalty=penalty, logit_bias=bias)], logits.view(1, 1, V))
    assert torch.equal(got[0, 0], hf[0])


def _penalised_case(temperature: float, top_k: int, params: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(K + 1, V, generator=g) * 1.5  # [K+1, V] raw logits, the same whatever came before
    target[1] = 0.6 * target[0] + torch.randn(V, generator=g)  # the likely first tokens are likely again
    draft = target[:K] + torch.randn(K, V, generator=g)  # [K, V]
    wp = WarpParams.build([(temperature, top_k, 1.0, 0.0)] * (K + 1), torch.device("cpu"))
    q = warp(draft, WarpParams.build([(temperature, top_k, 1.0, 0.0)] * K, torch.device("cpu")))  # [K, V]
    sp = dict(temperature=temperature, top_k=top_k, **params)

    prompt = target[0].topk(4, largest=False).indices.tolist()  # the least likely: the drafts are new tokens

    def p_after(output: list[int]) -> torch.Tensor:
        """The penalised, warped target at the position after `output`: [K+1, V] (row j's position)."""
        e = _entry(prompt, output, [], **sp)
        return warp(penalise([e], target.view(1, K + 1, V))[0], wp)

    return target, q, wp, sp, prompt, p_after


@pytest.mark.parametrize("dense", [True, False], ids=["dense-q", "one-hot-q"])
@pytest.mark.parametrize("temperature,top_k,params", [
    (1.0, 0, dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={3: 2.0, 5: -100.0})),
    (0.7, 0, dict(repetition_penalty=1.8, logit_bias={0: 1.5})),
    (1.3, 6, dict(frequency_penalty=2.0, repetition_penalty=0.8)),
])
def test_emitted_tokens_follow_the_penalised_target_distribution(dense, temperature, top_k, params):
    """Drafts drawn from an unpenalised q; the verify's rows penalised with each one's drafts before it
    counted: the first token follows the penalised p, and the second, given the first (an accepted
    draft), the penalised p with that token counted as output."""
    n = 20000
    target, q, wp, sp, prompt, p_after = _penalised_case(temperature, top_k, params, seed=int(temperature * 10) + top_k)
    # Twice a likely token, not the one-hot draft: penalties on it move p, and the draft is a new token.
    output = [next(t for t in target[0].argsort(descending=True).tolist() if t != int(q[0].argmax()))] * 2
    seeds = torch.arange(n, dtype=torch.int64) + 3 * top_k
    if dense:
        noise = rng.exponentials(seeds, torch.arange(K).expand(n, K), rng.DRAFT, V)
        drafts = (q.unsqueeze(0) / noise).argmax(-1)  # [N, K]
    else:
        drafts = q.argmax(-1).expand(n, K)
    entries = [_entry(prompt, output, d, **sp) for d in drafts.tolist()]
    rows = penalise(entries, target.expand(n, K + 1, V))  # [N, K+1, V]
    one = WarpParams.build([(temperature, top_k, 1.0, 0.0)], torch.device("cpu"))
    p = warp(rows.view(-1, V), one, reps=n * (K + 1)).view(n, K + 1, V)
    positions = torch.arange(K + 1).expand(n, K + 1)
    tokens, accepted = rejection_sample(VerifyInput(
        target_probs=p, target_argmax=rows.argmax(-1), draft_ids=drafts,
        draft_probs=q.expand(n, K, V) if dense else None, dense_q=torch.full((n,), dense),
        num_drafts=torch.full((n,), K), greedy=torch.zeros(n, dtype=torch.bool),
        uniforms=rng.uniforms(seeds, positions[:, :K], rng.ACCEPT), noise=rng.exponentials(seeds, positions, rng.TARGET, V),
    ))
    assert chi_square_p(torch.bincount(tokens[:, 0], minlength=V), p_after(output)[0]) > 1e-3
    # The second token, per first token a: against p at row 1 with a counted. Cells pooled over a.
    observed, expected = [], []
    second = accepted >= 1
    for a in tokens[second, 0].unique().tolist():
        rows_a = second & (tokens[:, 0] == a)
        observed.append(torch.bincount(tokens[rows_a, 1], minlength=V))
        expected.append(p_after(output + [a])[1] * rows_a.sum())
    obs, exp = torch.cat(observed), torch.cat(expected)
    assert chi_square_p(obs, exp / exp.sum()) > 1e-3
    rate = second.float().mean().item()
    assert 0.02 < rate < 0.999
    # The setting is one these checks tell apart: the penalties move p, and counting the first
    # token moves the second's.
    assert (p_after(output)[0] - warp(target, wp)[0]).abs().sum() > 0.1
    firsts = torch.bincount(tokens[second, 0], minlength=V) / second.sum()
    moved = sum(firsts[a] * (p_after(output + [a])[1] - p_after(output)[1]).abs().sum() for a in range(V))
    assert moved > 0.05
