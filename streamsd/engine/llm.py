"""The offline batch API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from streamsd.config import EngineConfig, SpecConfig, SpecMethod, TreeShape
from streamsd.engine.builder import build_runtime
from streamsd.engine.core import EngineCore, RequestOutput
from streamsd.engine.detokenizer import TokenInfo
from streamsd.request import SamplingParams, SpecStats


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    tokens: list[TokenInfo] = field(default_factory=list)

    @property
    def logprobs(self) -> list[float | None]:
        return [t.logprob for t in self.tokens]


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    spec_stats: SpecStats
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache supplied
    # With SamplingParams.prompt_logprobs, as vLLM's: None for the first prompt token, then each one's
    # (logprob, top alternatives as (token id, logprob)).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


class LLM:
    def __init__(
        self,
        model: str,
        draft_model: str | None = None,
        speculative_method: SpecMethod | None = None,
        num_speculative_tokens: int = 4,
        draft_greedy_threshold: float = 0.75,
        device: str | None = None,
        dtype: str = "auto",
        kv_cache_tokens: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        speculation_policy: Literal["adaptive", "fixed"] = "fixed",
        pipeline: bool | None = None,
        speculative_tree: str | TreeShape | None = None,
        int8_draft_head: bool = True,
        speculative_max_batch: int = 0,
        generation_config: str = "auto",
        enable_prefix_caching: bool = True,
        exact: bool = False,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        chat_template: str | None = None,
        seed: int | None = None,
        cuda_graphs: bool = True,
    ):
        if speculative_method is None and draft_model is not None:
            speculative_method = "draft"
        tree = TreeShape.parse(speculative_tree) if isinstance(speculative_tree, str) else speculative_tree
        if tree is not None:
            num_speculative_tokens = tree.nodes  # a tree verifies all its nodes
        spec = SpecConfig(method=speculative_method, num_tokens=num_speculative_tokens,
                          draft_model=draft_model, draft_greedy_threshold=draft_greedy_threshold,
                          policy=speculation_policy, tree=tree, int8_draft_head=int8_draft_head,
                          max_batch=speculative_max_batch)
        cfg = EngineConfig(model=model, spec=spec, device=device, dtype=dtype, kv_cache_tokens=kv_cache_tokens,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_queue=1 << 40, pipeline=pipeline,  # offline: every prompt waits its turn
                           generation_config=generation_config, enable_prefix_caching=enable_prefix_caching,
                           exact=exact, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization, chat_template=chat_template, seed=seed,
                           cuda_graphs=cuda_graphs)
        self.core = EngineCore(build_runtime(cfg), spec)
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the follower ranks of a tensor-parallel engine (nothing to do on one rank)."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's sampling defaults (generation_config.json, unless built with generation_config="none";
        else temperature 1), with ``overrides`` (any SamplingParams field) on top: what a call with no
        sampling_params samples with."""
        return self.core.rt.generation_defaults.sampling_params(**overrides)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.core.text.encode_prompt(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(ids, texts, sampling_params)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        ids = [self.core.text.encode_chat(c) for c in convs]  # type: ignore[arg-type]
        return self._run(ids, [None] * len(ids), sampling_params)

    def _run(self, ids: list[list[int]], texts: list[str | None],
             sampling_params: SamplingParams | list[SamplingParams] | None) -> list[GenerationResult]:
        params = sampling_params or self.get_default_sampling_params()
        per = params if isinstance(params, list) else [params] * len(ids)
        if len(per) != len(ids):
            raise ValueError("give one SamplingParams, or one per prompt")
        order: list[str] = []
        results: dict[str, GenerationResult] = {}
        for prompt_ids, text, p in zip(ids, texts, per, strict=True):
            rid = f"llm-{next(self._ids)}"
            self.core.add_request(rid, prompt_ids, p)
            order.append(rid)
            results[rid] = GenerationResult(rid, text, prompt_ids, [CompletionOutput(0, "", [], None)], SpecStats())
        for turn in self.core.run():
            for out in turn.outputs:
                self._merge(results[out.request_id], out)
        return [results[r] for r in order]

    @staticmethod
    def _merge(res: GenerationResult, out: RequestOutput) -> None:
        c = res.outputs[0]
        if out.prompt_logprobs is not None:
            res.prompt_logprobs = [None, *out.prompt_logprobs]
        c.text += out.text
        c.token_ids.extend(out.token_ids)
        c.tokens.extend(out.tokens)
        if out.finished:
            c.finish_reason = out.finish_reason
            res.spec_stats = out.stats or SpecStats()
            res.num_cached_tokens = out.cached_tokens
            res.error = out.error
