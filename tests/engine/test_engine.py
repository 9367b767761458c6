"""The speculative engine end to end on tiny random models: exactness, preemption, seeds, stops."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamsd import LLM, SamplingParams
from streamsd.request import FinishReason

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a tiny model",
    "1 2 3 4 5 6 7 8 9 10 11 12 13",
    "def add(a, b):",
    "Speculative decoding proposes tokens with a cheap draft and verifies them with the target. Speculative",
    "é",
]
MAX_TOKENS = [24, 9, 30, 17, 12, 5]


def hf_greedy(model_dir, prompts, max_tokens):
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p, n in zip(prompts, max_tokens, strict=True):
        ids = tok.encode(p)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def greedy_params():
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return hf_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)


def _assert_free(llm: LLM) -> None:
    s = llm.core.scheduler
    assert s.blocks.num_free == s.blocks.total, "KV blocks leaked"
    assert len(s.q_slots_free) == s.q_slots_total, "q slots leaked"
    assert not s.running and not s.waiting and not llm.core.trackers


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_draft_model_is_token_identical(tiny_model_dir, close_draft_dir, reference, k):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=k)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    stats = [r.spec_stats for r in res]
    assert sum(s.accepted for s in stats) > 0 and sum(s.drafted - s.accepted for s in stats) > 0
    _assert_free(llm)


def test_greedy_plain_and_ngram_and_random_draft_are_token_identical(tiny_model_dir, tiny_draft_dir, reference):
    for kw in ({}, {"speculative_method": "ngram"}, {"draft_model": str(tiny_draft_dir)}):
        llm = LLM(str(tiny_model_dir), **kw)
        res = llm.generate(PROMPTS, greedy_params())
        assert [r.outputs[0].token_ids for r in res] == reference, kw
        _assert_free(llm)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_chains_gated_by_the_batch_stay_exact(tiny_model_dir, close_draft_dir, reference, method):
    """speculative_max_batch=2 with a chain proposer: plain steps while three or more decode (a draft
    model falls behind and catches up once the batch is down to two), the same text as plain decoding."""
    draft = str(close_draft_dir) if method == "draft" else None
    llm = LLM(str(tiny_model_dir), speculative_method=method, draft_model=draft, speculative_max_batch=2)
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    drafted = [r.spec_stats.drafted for r in res]
    # the longest answer (30 tokens, counting) drafts once the batch is down to two; those ending while
    # three or more decode verify no drafts
    assert drafted[2] > 0
    if method == "draft":  # a close draft model, caught up, is accepted (n-gram guesses on this text fail)
        assert res[2].spec_stats.accepted > 0
    assert all(d == 0 for d, n in zip(drafted, MAX_TOKENS, strict=True) if n <= 17), drafted
    _assert_free(llm)


def test_qwen2_target_with_llama_draft(qwen_target_dir, tiny_draft_dir):
    ref = hf_greedy(qwen_target_dir, PROMPTS, MAX_TOKENS)
    llm = LLM(str(qwen_target_dir), draft_model=str(tiny_draft_dir), num_speculative_tokens=3)
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy_params())] == ref


def test_tiny_kv_pool_preempts_repeatedly_and_stays_exact(tiny_model_dir, close_draft_dir, reference):
    # 6 blocks of 16 tokens cannot hold all six requests at once: preemption by recompute.
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), kv_cache_tokens=96)
    preempted_drafts: list[tuple[str, list[int]]] = []
    verified_after: list[tuple[str, list[int]]] = []
    sched = llm.core.scheduler
    original = sched._preempt

    def spy(r):
        preempted_drafts.append((r.request_id, list(r.draft_ids)))
        original(r)

    sched._preempt = spy
    step = llm.core.rt.worker.step

    def spy_step(plan):
        for e in plan.entries:
            if e.verifies and e.request.num_preemptions and e.num_drafts:
                verified_after.append((e.request.request_id, e.request.draft_ids[: e.num_drafts]))
        return step(plan)

    llm.core.rt.worker.step = spy_step
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    assert len(preempted_drafts) >= 3
    # A preempted request verifies the very drafts it held when it was preempted.
    with_drafts = [(rid, d) for rid, d in preempted_drafts if d]
    assert with_drafts and any(pair in verified_after for pair in with_drafts)
    _assert_free(llm)


def test_seeded_output_is_independent_of_batch(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    for temp in (0.5, 1.0):  # one-hot drafts below the threshold, dense q above it
        p = SamplingParams(temperature=temp, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
        alone = llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
        others = [SamplingParams(temperature=1.0, max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate(range(3, 21))]
        batch = llm.generate(PROMPTS * 3 + PROMPTS[:1], others + [p])
        assert batch[-1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a, b = llm.generate([PROMPTS[0]] * 2, unseeded)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_abort_and_finish_mix_frees_every_block(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), kv_cache_tokens=256)
    core = llm.core
    for i, prompt in enumerate(PROMPTS * 2):
        core.add_request(f"r{i}", core.encode_prompt(prompt), SamplingParams(temperature=1.0, max_tokens=40, seed=i))
    finished: dict[str, str] = {}
    steps = 0
    while core.has_work:
        steps += 1
        if steps == 3:
            for i in range(0, 12, 3):
                core.abort(f"r{i}")
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
    assert len(finished) == 12
    assert {finished[f"r{i}"] for i in range(0, 12, 3)} == {"cancelled"}
    _assert_free(llm)


def test_stop_string_spanning_tokens(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), speculative_method="ngram")
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    texts = [t.text for t in base.tokens]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(3, len(texts) - 1) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 1)
    stop = texts[i][-2:] + texts[i + 1][:1]
    cut = base.text.index(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    o = out[0].outputs[0]
    assert o.text == base.text[:cut]
    assert o.finish_reason == FinishReason.STOP
    assert "".join(t.text for t in o.tokens) == o.text
    _assert_free(llm)


def test_stop_token_ids_min_tokens_and_eos(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    # min_tokens makes the stop id impossible before it, so the text changes but respects it.
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in out.token_ids[: first + 2]


def test_a_crashing_step_fails_only_its_requests(tiny_model_dir, close_draft_dir, reference):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    core = llm.core
    real = core.rt.worker.step

    def flaky(plan):
        if any(e.request.request_id == "bad" for e in plan.entries):
            raise RuntimeError("injected fault")
        return real(plan)

    core.rt.worker.step = flaky
    core.add_request("bad", core.encode_prompt(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=5))
    outs = core.step()
    assert outs and outs[0].error and "injected fault" in outs[0].error and outs[0].finish_reason == "error"
    res = llm.generate(PROMPTS, greedy_params())
    assert [r.outputs[0].token_ids for r in res] == reference
    _assert_free(llm)


def test_logprobs_are_the_target_log_softmax(tiny_model_dir, close_draft_dir):
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir))
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    for j, t in enumerate(out.outputs[0].tokens):
        assert abs(t.logprob - logp[n - 1 + j, t.id].item()) < 1e-4
        assert t.top_logprobs[0][0] == t.id and len(t.top_logprobs) == 3


def test_out_of_range_params_are_clear_errors():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_prompt_longer_than_context_is_refused(tiny_model_dir):
    llm = LLM(str(tiny_model_dir))
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[5] * 4000], SamplingParams(max_tokens=200))
    _assert_free(llm)


def _target_next_token_probs(model_dir, ids, temperature, top_k, top_p, min_p, penalised=None):
    """The target's warped p after `ids`; `penalised`: (prompt length, params) whose bias and penalties
    apply first (the tokens past the prompt count as output)."""
    from streamsd.sample.warp import WarpParams, warp
    from tests.sample.test_penalties import penalised_reference

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1:].float()
    if penalised is not None:
        n, params = penalised
        logits = penalised_reference(logits[0], ids[:n], ids[n:], params).view(1, -1)
    return warp(logits, WarpParams.build([(temperature, top_k, top_p, min_p)], torch.device("cpu")))[0]


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(0.5, 0, 1.0, 0.0), (1.0, 8, 1.0, 0.0), (1.5, 0, 0.9, 0.0), (1.2, 0, 1.0, 0.05)],
)
def test_end_to_end_sampling_matches_target_distribution(tiny_model_dir, close_draft_dir, temperature, top_k,
                                                         top_p, min_p):
    """3000 seeds: the joint of the first two tokens is the target's exact warped p (t2 comes from verification)."""
    n = 3000
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3,
              max_num_seqs=n, kv_cache_tokens=n * 48, max_num_batched_tokens=16384)
    prompt = llm.core.encode_prompt("Once upon a time")
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=4,
                             seed=s, ignore_eos=True) for s in range(n)]
    res = llm.generate([prompt] * n, params)
    assert sum(r.spec_stats.accepted for r in res) > 0
    assert_pairs_follow_target(tiny_model_dir, prompt, res, (temperature, top_k, top_p, min_p))


def assert_pairs_follow_target(model_dir, prompt: list[int], res: list, warp: tuple,
                               params: SamplingParams | None = None) -> None:
    """The first two tokens of the answers `res` (one per seed) against the target's exact warped
    joint p(t1) p(t2 | t1): no forbidden pair, and a chi-square test (sparse cells pooled). With
    `params`, p is penalised by its logit bias and penalties first."""
    n = len(res)
    pairs = [tuple(r.outputs[0].token_ids[:2]) for r in res]
    penalised = None if params is None else (len(prompt), params)
    p1 = _target_next_token_probs(model_dir, prompt, *warp, penalised=penalised)
    firsts = sorted({a for a, _ in pairs} | set((p1 > 0.01).nonzero().flatten().tolist()))
    observed, expected = [], []
    for a in firsts:
        p2 = _target_next_token_probs(model_dir, prompt + [a], *warp, penalised=penalised)
        for b in range(p2.numel()):
            e = n * p1[a].item() * p2[b].item()
            o = sum(1 for x in pairs if x == (a, b))
            assert e > 0 or o == 0, "emitted a pair the target forbids"
            observed.append(o)
            expected.append(e)
    obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    big = exp >= 5
    o2 = torch.cat([obs[big], obs[~big].sum().view(1)])
    e2 = torch.cat([exp[big], exp[~big].sum().view(1)])
    e2 = e2 * o2.sum() / e2.sum()
    assert chisquare(o2.numpy(), e2.numpy()).pvalue > 1e-3


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from streamsd.model.loader import ModelLoadError
    from tests.tiny import build_model, build_tokenizer

    other = build_model(tmp_path / "other", tokenizer=build_tokenizer(vocab_size=300), seed=2)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(str(tiny_model_dir), draft_model=str(other))


@pytest.mark.parametrize("kw", [{"speculative_method": "ngram"}, {"draft_model": "close"}], ids=["ngram", "draft"])
def test_adaptive_policy_keeps_greedy_output_identical(tiny_model_dir, close_draft_dir, reference, kw):
    kw = {k: str(close_draft_dir) if v == "close" else v for k, v in kw.items()}
    llm = LLM(str(tiny_model_dir), speculation_policy="adaptive", **kw)
    res = llm.generate(PROMPTS * 2, greedy_params() * 2)
    assert [r.outputs[0].token_ids for r in res] == reference * 2
    policy = llm.core.scheduler.policy
    assert policy.record.steps > 0 and sum(policy.record.chosen_k.values()) > 0
    assert policy.record.last_measured > 0 and policy.cost.verify.keys  # profiled at start, corrected online
    _assert_free(llm)


def test_pipelined_steps_match_sequential_steps_with_stop_strings(tiny_model_dir, close_draft_dir):
    """EngineCore.run detokenises step N while step N+1 runs: a request that hits a stop string is
    then still in the running step. Its extra tokens must vanish and every output must equal what
    one-step-at-a-time gives, with nothing leaked."""
    llm = LLM(str(tiny_model_dir), draft_model=str(close_draft_dir), num_speculative_tokens=3)
    bases = llm.generate(PROMPTS, greedy_params())
    params = []
    for base, p in zip(bases, greedy_params(), strict=True):
        text = base.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2] if len(text) > 6 else None
        params.append(SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True,
                                     stop=[stop] if stop and stop.strip() else None))
    assert sum(p.stop is not None for p in params) >= 3

    def collect(step_outputs) -> dict:
        got: dict[str, list] = {}
        for outputs in step_outputs:
            for o in outputs:
                g = got.setdefault(o.request_id, ["", [], None, 0])
                g[0] += o.text
                g[1] += o.token_ids
                if o.finished:
                    g[2], g[3] = o.finish_reason, o.completion_tokens
                    g.append("finished")
        return got

    def submit(tag: str) -> None:
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            llm.core.add_request(f"{tag}{i}", llm.core.encode_prompt(prompt), p)

    submit("s")
    sequential = []
    while llm.core.has_work:
        sequential.append(llm.core.step())
    _assert_free(llm)
    submit("p")
    settled: list = []
    real_settle = llm.core.settle

    def counting_settle() -> list:
        outs = real_settle()
        settled.extend(outs)
        return outs

    llm.core.settle = counting_settle
    pipelined = collect(turn.outputs for turn in llm.core.run())
    assert settled, "no stop string was found under a running step: the deferred path went untested"
    _assert_free(llm)
    sequential = collect(sequential)
    stopped = 0
    for i in range(len(PROMPTS)):
        s, p = sequential[f"s{i}"], pipelined[f"p{i}"]
        assert p == s and s[-1] == "finished"  # one finished output each, same text, ids and counts
        assert s[3] == len(s[1])
        stopped += s[2] == "stop"
    assert stopped >= 3


def test_a_step_failing_under_a_deferred_stop_ends_each_request_once(tiny_model_dir):
    """A stop string found while step N+1 runs, and step N+1 then fails: the stopped request keeps its
    stop (one final output), the others of that step fail, nothing leaks."""
    import time

    llm = LLM(str(tiny_model_dir))
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 2]
    core = llm.core
    real = core.rt.worker.step

    def failing_after_a_stop(plan):
        res = real(plan)
        time.sleep(0.05)  # the loop thread detokenises the previous step meanwhile
        if core._stopped:
            raise RuntimeError("injected fault")
        return res

    core.rt.worker.step = failing_after_a_stop
    core.add_request("stopper", core.encode_prompt(PROMPTS[1]),
                     SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    core.add_request("bystander", core.encode_prompt(PROMPTS[0]),
                     SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    finals: dict[str, list[str]] = {}
    for turn in core.run():
        for o in turn.outputs:
            if o.finished:
                finals.setdefault(o.request_id, []).append(o.finish_reason)
    assert finals == {"stopper": ["stop"], "bystander": ["error"]}
    _assert_free(llm)


def test_the_cpu_path_never_imports_triton(tiny_model_dir, close_draft_dir, tmp_path):
    """A CPU engine (with a draft model, so both models load) answers without importing Triton: its
    native module reports hundreds of leaked objects at every exit."""
    code = (
        "import sys\n"
        "from streamsd import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, draft_model={str(close_draft_dir)!r}, device='cpu')\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=6, temperature=0.0))\n"
        "assert out[0].outputs[0].token_ids, out\n"
        "print('triton' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["STREAMSD_HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"], done.stdout
    assert "nanobind" not in done.stderr
