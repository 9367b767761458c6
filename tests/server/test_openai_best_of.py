"""`best_of` on /v1/completions: the n candidates of highest cumulative logprob out of best_of, usage
counting every candidate, and the 400s; against a real server that speculates with a draft model."""

from __future__ import annotations

import httpx
import pytest

from tests.server_util import metric

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _sampled(client, model, **kw):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11,
                                     extra_body={"ignore_eos": True}, **kw)


def test_best_of_answers_with_the_candidates_of_highest_cumulative_logprob(client, model):
    # best_of candidates are sampled as n of them are: n=3 with the same seed shows every candidate.
    every = _sampled(client, model, n=3, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    assert len(set(sums)) == 3, sums
    ranked = sorted(range(3), key=lambda j: -sums[j])
    one = _sampled(client, model, n=1, best_of=3)
    assert [c.index for c in one.choices] == [0]
    assert one.choices[0].text == every.choices[ranked[0]].text
    assert one.choices[0].logprobs is None  # the ranking's logprobs are not the client's
    assert one.usage.completion_tokens == 3 * 8 and one.usage.prompt_tokens == every.usage.prompt_tokens
    two = _sampled(client, model, n=2, best_of=3, logprobs=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [every.choices[j].text for j in ranked[:2]]
    assert [sum(c.logprobs.token_logprobs) for c in two.choices] == pytest.approx([sums[j] for j in ranked[:2]])
    assert two.usage.completion_tokens == 3 * 8


def test_best_of_ranks_each_prompt_of_a_list_on_its_own(client, model):
    prompts = [PROMPT, "The capital of France"]
    kw = dict(model=model, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    every = client.completions.create(n=2, logprobs=0, **kw)
    best = client.completions.create(n=1, best_of=2, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    for i in range(2):
        mine = every.choices[2 * i : 2 * i + 2]
        top = max(mine, key=lambda c: sum(c.logprobs.token_logprobs))
        assert best.choices[i].text == top.text
    assert best.usage.completion_tokens == 4 * 6 and best.usage.prompt_tokens == every.usage.prompt_tokens


@pytest.mark.parametrize("extra", [{"n": 3, "best_of": 2}, {"best_of": 21}, {"n": 2, "best_of": 21},
                                   {"best_of": 2, "stream": True}, {"prompt": ["a"] * 10, "best_of": 13}],
                         ids=["below-n", "above-20", "n-2-above-20", "streamed", "prompts-x-best_of-over-128"])
def test_best_of_out_of_bounds_or_streamed_is_refused_by_name(server, extra):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "best_of", r.json()
    assert metric(server.url, "streamsd:num_requests_running") == 0


def test_best_of_equal_to_n_streams(client, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, best_of=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
