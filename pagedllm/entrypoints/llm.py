"""The offline API, a drop-in for vLLM's ``LLM``."""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import fields

from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.vllm_args import unknown_keyword_error
from pagedllm.metrics.stats import KVCacheStats, Metric
from pagedllm.outputs import BeamSearchOutput, EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    """Loads a model and generates for batches of prompts with continuous batching.

    Accepts every keyword of vLLM's ``LLM`` and ``EngineArgs`` (the version and the list are in
    engine/vllm_engine_args.json): the ones pagedllm honours do what vLLM's do, the others are
    accepted at the values that change nothing here and refused with a ``ValueError`` saying why at
    any other; pagedllm's own options (``swap_space``, ``kv_offload_cpu_gb``, ...) too. An unknown
    keyword raises ``TypeError`` naming the closest valid one. ``chat_template`` (a file or the
    template itself) replaces the tokenizer's for ``chat()``; ``data_parallel_size`` > 1 is refused
    (``pagedllm serve --data-parallel-size N`` runs replicas).

    ``shutdown()`` (or leaving ``with LLM(...) as llm:``) stops the tensor-parallel workers,
    destroys the engine's process group and frees the KV pool and the weights; dropping the last
    reference or interpreter exit does the same. Several engines may live in one process, one
    after another or side by side: each owns its own group.
    """

    def __init__(self, model: str = "pagedllm-demo", *, chat_template: str | os.PathLike | None = None, **kwargs):
        valid = [f.name for f in fields(EngineArgs)]
        for name in kwargs:
            if name not in valid:
                raise unknown_keyword_error(name, [*valid, "chat_template"], "LLM")
        args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()
        if chat_template is not None:
            from pagedllm.entrypoints.openai.api_server import load_chat_template
            self.get_tokenizer().chat_template = load_chat_template(os.fspath(chat_template))

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Releases the engine's processes, process group and memory; generating afterwards raises
        RuntimeError. Idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in input order.

        ``priority``: one per prompt, for an engine built with ``scheduling_policy="priority"``
        (lower values are scheduled first); a prompt dict may carry vLLM's ``"cache_salt"``."""
        prompts = _as_list(prompts)
        default = self.get_default_sampling_params() if sampling_params is None else None
        params = [_final_only(p) for p in _per_prompt(sampling_params, SamplingParams, default, len(prompts),
                                                            "sampling_params")]
        ids = self._add_all(prompts, params, priorities=priority)
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (``out.outputs.embedding``), in input order; needs an engine
        built with ``runner="pooling"`` (``pooler_config`` sets the pooling and normalization)."""
        prompts = _as_list(prompts)
        params = _per_prompt(pooling_params, PoolingParams, None, len(prompts), "pooling_params")
        ids = self._add_all(prompts, params, self.llm_engine.add_pooling_request, priorities=priority)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        prompts = [{"prompt_token_ids": _as_ids(tok.apply_chat_template(
            conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=True))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no sampling_params: the model's generation_config.json
        defaults (unless the engine was built with ``generation_config="vllm"``)."""
        return self.llm_engine.get_default_sampling_params()

    def _add_all(self, prompts, params, add: Callable | None = None,
                 priorities: Sequence[int] | None = None) -> list[str]:
        """Queues every prompt with ``add`` (default ``add_request``); if one is refused, the
        ones already queued are aborted, so a bad prompt leaves nothing behind."""
        if priorities is not None and len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts; give one per prompt")
        engine = self.llm_engine
        add = add or engine.add_request
        ids = [str(next(self._counter)) for _ in prompts]
        added = []
        try:
            for rid, prompt, p, priority in zip(ids, prompts, params, priorities or itertools.repeat(0)):
                add(rid, prompt, p, priority=priority)
                added.append(rid)
        except Exception:
            engine.abort_request(added)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        def finished(outputs: list[RequestOutput], _pending: set[str]):
            return [(out.request_id, out) for out in outputs if out.finished]
        return self._drive(ids, "Processed prompts", use_tqdm, finished)

    def _drive(self, ids: list[str], desc: str, use_tqdm: bool, take_finished) -> list:
        """Steps the engine until every id in ``ids`` has its result (``take_finished(outputs,
        pending)`` picks them from a step's outputs); on any error, Ctrl-C included, aborts the ids
        still running. ``pending`` is a set, so each step costs O(outputs), not O(outputs * ids)."""
        engine = self.llm_engine
        results: dict[str, object] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc=desc, disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)} were aborted")
                for rid, out in take_finished(engine.step(), pending):
                    if rid in pending:
                        pending.discard(rid)
                        results[rid] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search as vLLM's ``LLM.beam_search``; beams share blocks via fork and copy-on-write.

        The searches run in the engine's ordinary steps, so requests already in flight keep
        running beside them (their outputs are not returned here).
        """
        engine = self.llm_engine
        prompts = _as_list(prompts)
        ids = self._add_all(prompts, [params] * len(prompts), engine.add_beam_search)

        def finished(_outputs, pending: set[str]):  # beam results come from the engine, not the step's outputs
            return [(rid, out) for rid in pending if (out := engine.take_beam_search_output(rid)) is not None]
        return self._drive(ids, "Beam search", use_tqdm, finished)

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def get_kv_cache_stats(self) -> KVCacheStats:
        return self.llm_engine.get_kv_cache_stats()

    def reset_prefix_cache(self, reset_disk: bool = False) -> bool:
        """Forgets cached prefixes (device pool, CPU tier; the disk tier too with ``reset_disk``)."""
        return self.llm_engine.reset_prefix_cache(reset_disk)


def _final_only(params: SamplingParams) -> SamplingParams:
    """generate() returns finished outputs only, so the engine need not build partial ones."""
    params = params.clone()
    params.output_kind = "final_only"
    return params


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [{"prompt_token_ids": list(prompts)}]
    return list(prompts)


def _as_ids(x) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "keys"):
        return list(x["input_ids"])
    return list(x)


def _per_prompt(given, kind: type, default, n: int, name: str) -> list:
    """One params object per prompt: ``default`` for None, a single one repeated, or a list of n
    (any other length is a ValueError naming the argument ``name``)."""
    if given is None or isinstance(given, kind):
        return [default if given is None else given] * n
    if len(given) != n:
        raise ValueError(f"got {len(given)} {name} for {n} prompts; pass one or one per prompt")
    return list(given)
