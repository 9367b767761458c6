"""Engine options as a vLLM user sets them: `max_model_len` honoured or refused, the KV cache sized by
`gpu_memory_utilization` (vLLM's share of the GPU's whole memory), a `chat_template` of one's own, and
`seed` for requests that give none."""

from __future__ import annotations

import pytest
import torch

from streamsd import LLM, SamplingParams
from streamsd.config import EngineConfig
from streamsd.engine.kv_sizing import kv_blocks, kv_cache_bytes, process_free

GIB = 2**30


def test_max_model_len_bounds_every_request(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), max_model_len=40)
    assert llm.core.scheduler.cfg.max_model_len == 40
    with pytest.raises(ValueError, match="context window"):
        llm.generate([[5] * 30], SamplingParams(max_tokens=11))
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=10, ignore_eos=True, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 10


def test_a_max_model_len_the_engine_cannot_hold_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-model-len 100000 is more than this engine can hold"):
        LLM(str(tiny_model_dir), max_model_len=100_000)
    with pytest.raises(ValueError, match="the KV cache 256"):
        LLM(str(tiny_model_dir), max_model_len=1024, kv_cache_tokens=256)


def test_the_kv_cache_takes_its_share_of_what_the_server_may_use():
    # All that is free once the weights are loaded (the default) ...
    assert kv_cache_bytes(100 * GIB, 140 * GIB, None, 0.85) == int(100 * GIB * 0.85)
    # ... or vLLM's share of the whole memory, less what the weights already use.
    assert kv_cache_bytes(130 * GIB, 140 * GIB, 0.9, 0.85) == int((126 - 10) * GIB * 0.85)
    assert kv_cache_bytes(130 * GIB, 140 * GIB, 1.0, 0.85) == int(130 * GIB * 0.85)  # never more than is free
    with pytest.raises(ValueError, match="leaves no memory for the KV cache: 70.0 of 140.0 GiB"):
        kv_cache_bytes(70 * GIB, 140 * GIB, 0.5, 0.85)


def test_a_process_limited_to_a_share_of_the_gpu_sizes_within_it():
    # Unlimited (torch's default fraction 1.0): everything free.
    assert process_free(100 * GIB, 140 * GIB, 1.0, 20 * GIB) == 100 * GIB
    # A quarter of 140 GiB, 5 GiB of it held already: 30 GiB more, however much more the GPU has free.
    assert process_free(100 * GIB, 140 * GIB, 0.25, 5 * GIB) == 30 * GIB
    # Never more than the GPU has free (other processes hold the rest), and never below nothing.
    assert process_free(10 * GIB, 140 * GIB, 0.25, 5 * GIB) == 10 * GIB
    assert process_free(100 * GIB, 140 * GIB, 0.25, 40 * GIB) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_named_without_an_index_is_sized_as_the_current_one():
    """`--device cuda` (no index), the server's default on a GPU: the share and the free memory are the
    current device's."""
    cfg = EngineConfig(model="m")
    index = torch.cuda.current_device()
    assert kv_blocks(cfg, 4096, torch.device("cuda")) == kv_blocks(cfg, 4096, torch.device("cuda", index)) > 0


def test_gpu_memory_utilization_is_checked_and_refused_where_it_means_nothing(tiny_model_dir):
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(model="m", gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", gpu_memory_utilization=0.9, kv_cache_tokens=4096)
    with pytest.raises(ValueError, match="on a CPU give --kv-cache-tokens"):
        LLM(str(tiny_model_dir), device="cpu", gpu_memory_utilization=0.9)


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


def test_a_chat_template_given_replaces_the_tokenizers_inline_or_from_a_file(tiny_model_dir, tmp_path):
    convo = [{"role": "user", "content": "Hello"}]
    inline = LLM(str(tiny_model_dir), chat_template=TEMPLATE)
    assert inline.core.text.render_chat(convo) == "[user] Hello\n[assistant]"
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    from_file = LLM(str(tiny_model_dir), chat_template=str(path))
    assert from_file.core.text.render_chat(convo) == "[user] Hello\n[assistant]"
    out = from_file.chat([convo], SamplingParams(max_tokens=3, temperature=0))
    assert out[0].prompt_token_ids == from_file.core.text.encode_rendered_chat("[user] Hello\n[assistant]")
    # a one-line template longer than any file name is taken as the template, not refused as a path
    long_line = TEMPLATE.replace("\n", " ").replace("[assistant]", "[assistant]" + "{# " + "x" * 300 + " #}")
    assert LLM(str(tiny_model_dir), chat_template=long_line).core.text.render_chat(convo) == "[user] Hello [assistant]"
    with pytest.raises(ValueError, match="--chat-template does not render a conversation"):
        LLM(str(tiny_model_dir), chat_template="{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")


def test_a_seeded_engine_answers_unseeded_requests_alike_after_a_restart(tiny_model_dir):
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]

    def answers(seed: int | None) -> list[list[int]]:
        llm = LLM(str(tiny_model_dir), seed=seed)
        return [r.outputs[0].token_ids for r in llm.generate(prompts, params) + llm.generate(prompts, params)]

    first = answers(7)
    assert answers(7) == first  # a restart with the same seed
    assert answers(8) != first and answers(None) != first
    assert first[:2] != first[2:]  # each request draws a seed of its own
