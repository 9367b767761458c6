"""Tiny random models for tests: a byte-level BPE tokenizer trained on a few sentences, a chat
template, and Llama / Qwen2 configs small enough to run in milliseconds on a CPU.

Target and draft are built with different seeds so the rejection paths are exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Speculative decoding proposes tokens with a cheap draft and verifies them with the target.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a tiny model that loved to stream tokens to the browser.",
    "Über naïve café — multi-byte characters: 日本語, emoji 🚀 and accents é è ê.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 4


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(family: str, vocab: int, seed_shape: dict) -> LlamaConfig | Qwen2Config:
    common = dict(
        vocab_size=vocab,
        hidden_size=seed_shape.get("hidden", 64),
        intermediate_size=seed_shape.get("intermediate", 128),
        num_hidden_layers=seed_shape.get("layers", 2),
        num_attention_heads=seed_shape.get("heads", 4),
        num_key_value_heads=seed_shape.get("kv_heads", 2),
        max_position_embeddings=seed_shape.get("max_pos", 512),
        tie_word_embeddings=seed_shape.get("tied", False),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0)
    rope = seed_shape.get("rope_scaling")
    cfg = LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope)
    return cfg


def build_model(
    out_dir: Path,
    *,
    family: str = "llama",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    weight_scale: float = 1.0,
    **shape: object,
) -> Path:
    """Write a tiny random HF model directory (config, safetensors, tokenizer) and return it."""
    tokenizer = tokenizer or build_tokenizer()
    cfg = _config(family, len(tokenizer), shape)
    torch.manual_seed(seed)
    model = (Qwen2ForCausalLM if family == "qwen2" else LlamaForCausalLM)(cfg).float().eval()
    if weight_scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(weight_scale)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def build_perturbed(src: Path, out_dir: Path, *, noise: float, seed: int = 7) -> Path:
    """A draft that agrees with its target often but not always: the target's weights plus noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out_dir)
    return out_dir


def hf_logprobs(model_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """The reference for prompt scoring: ids -> transformers' log_softmax at every position, [T, V]."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]

    return logprobs
