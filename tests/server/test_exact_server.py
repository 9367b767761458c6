"""`streamsd serve --exact`: greedy and seeded sampled answers are the same tokens whether a request
speculates or not and whatever else its steps hold (here: the same prompts at once, half of them with
speculation off)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server_util import metric, start_server

PROMPTS = ["The capital of France is", "Once upon a time there was a tiny model", "1 2 3 4 5 6 7", "def add(a, b):",
           "é", "Speculative decoding proposes tokens"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, close_draft_dir, tmp_path_factory):
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "--draft-model", str(close_draft_dir),
                     "--num-speculative-tokens", "3", "--speculation-policy", "fixed", "--exact")
    yield s
    s.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_exact_server_answers_alike_with_and_without_speculation(server, sampling):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id

    def ask(job: tuple[str, bool]) -> tuple[str, int]:
        prompt, speculate = job
        r = client.completions.create(model=model, prompt=prompt, max_tokens=24, **sampling,
                                      extra_body={"ignore_eos": True, "speculative": {"enabled": speculate}})
        return r.choices[0].text, r.usage.completion_tokens

    alone = [ask((p, False)) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(ask, [(p, s) for s in (True, False) for p in PROMPTS]))
    assert together == alone * 2
    assert all(n == 24 for _, n in alone)
    assert metric(server.url, "streamsd:spec_decode_num_accepted_tokens_total") > 0  # the verify windows ran
