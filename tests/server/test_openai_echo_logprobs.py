"""`echo` with `logprobs` on /v1/completions: the choice's logprobs cover the prompt's tokens (scored
by the target's prefill: equal to a plain transformers forward's log_softmax) then the completion's,
streamed or not, whatever the prefix cache holds; against a real server that speculates with a draft
model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from tests.tiny import CORPUS, hf_logprobs

PROMPT = "Once upon a time there was a tiny model"


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_logprobs(tiny_model_dir)


def _check_prompt_part(lp, ids: list[int], tok, expected: torch.Tensor, top: int) -> None:
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [expected[p - 1, ids[p]].item() for p in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-3)
    for p in range(1, n):
        vals, alts = expected[p - 1].topk(top)
        # keyed by token text: alternatives that decode alike share an entry
        assert len(lp.top_logprobs[p]) <= top
        for text, v in lp.top_logprobs[p].items():
            assert text in {tok.decode([i]) for i in alts.tolist()}
            assert v == pytest.approx(max(x for x, i in zip(vals.tolist(), alts.tolist(), strict=True)
                                          if tok.decode([i]) == text), abs=1e-3)
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:p]) for p in range(n)]


def test_echo_with_logprobs_scores_the_prompt_as_a_plain_forward_then_the_completion(client, model, tok, reference):
    ids = tok.encode(PROMPT)
    done = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = done.choices[0]
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 6
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 6
    _check_prompt_part(lp, ids, tok, reference(ids), 2)
    # the completion's part, as without echo
    plain = client.completions.create(model=model, prompt=PROMPT, logprobs=2, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert lp.tokens[len(ids):] == plain.logprobs.tokens and "".join(plain.logprobs.tokens) == choice.text[len(PROMPT):]
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset[len(ids):] == [len(PROMPT) + o for o in plain.logprobs.text_offset]


def test_streamed_echo_with_logprobs_brings_the_prompt_in_its_first_chunk(client, model, tok):
    kw = dict(model=model, prompt=PROMPT, echo=True, logprobs=1, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    first = chunks[0].choices[0]
    n = len(tok.encode(PROMPT))
    assert first.text.startswith(PROMPT) and first.logprobs.tokens[:n] == whole.logprobs.tokens[:n]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    scores = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert scores[0] is None and scores[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_echo_with_logprobs_recomputes_a_cached_prompt_and_scores_every_sample(client, model, tok, reference):
    prompt = " ".join(CORPUS[:3])  # several KV blocks
    ids = tok.encode(prompt)
    client.completions.create(model=model, prompt=prompt, max_tokens=2)  # its blocks now cached
    done = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=0, max_tokens=3, n=2,
                                     temperature=1.0, seed=3)
    assert done.usage.prompt_tokens_details is None or not done.usage.prompt_tokens_details.cached_tokens
    expected = reference(ids)
    for choice in done.choices:
        _check_prompt_part(choice.logprobs, ids, tok, expected, 0)
        assert choice.logprobs.top_logprobs[1:len(ids)] == [{}] * (len(ids) - 1)
    hit = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0  # the others still take the cache


def test_echo_with_logprobs_of_a_one_token_prompt_has_its_null_entry(client, model, tok):
    ids = tok.encode("Once")[:1]
    done = client.completions.create(model=model, prompt=ids, echo=True, logprobs=1, max_tokens=2,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.tokens[0] == tok.decode(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(client, model, tok, reference, stream):
    """lm-evaluation-harness's loglikelihood request: the prompt (context + continuation) scored, no
    token generated, a list of prompts in one request."""
    prompts = [PROMPT, " ".join(CORPUS[:2])]
    kw = dict(model=model, prompt=prompts, echo=True, logprobs=1, max_tokens=0, temperature=0)
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        choices = {}
        for c in chunks:
            for ch in c.choices:
                choices.setdefault(ch.index, []).append(ch)
        got = [(("".join(x.text for x in parts)), [t for x in parts if x.logprobs for t in x.logprobs.token_logprobs],
                parts[-1].finish_reason) for _, parts in sorted(choices.items())]
    else:
        done = client.completions.create(**kw)
        assert done.usage.completion_tokens == 0
        assert done.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
        got = [(c.text, c.logprobs.token_logprobs, c.finish_reason) for c in done.choices]
        for c, p in zip(done.choices, prompts, strict=True):
            _check_prompt_part(c.logprobs, tok.encode(p), tok, reference(tok.encode(p)), 1)
    for (text, scores, finish), p in zip(got, prompts, strict=True):
        ids = tok.encode(p)
        assert text == p and finish == "length" and len(scores) == len(ids)
        want = reference(ids)
        assert scores[0] is None
        assert scores[1:] == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-3)


def test_max_tokens_0_without_echo_and_on_chat_is_refused(server, model):
    import httpx

    r = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in (r.json()["error"]["param"] or r.json()["error"]["message"])
