"""The offline API, a drop-in for vLLM's ``LLM``."""
from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import fields

import torch
from tqdm.auto import tqdm

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.vllm_args import unknown_keyword_error
from pagedllm.entrypoints import score_utils
from pagedllm.entrypoints.openai.chat_features import load_chat_template
from pagedllm.entrypoints.openai.media import MediaPolicy, load_image, load_video
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import KVCacheStats, Metric
from pagedllm.multimodal.embeds import chat_embeds
from pagedllm.outputs import (
    BeamSearchOutput,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams, check_task
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
        return self.llm_engine.get_tokenizer()

    def set_tokenizer(self, tokenizer) -> None:
        """Uses ``tokenizer`` for prompts and outputs from now on (an idle engine only)."""
        self.llm_engine.set_tokenizer(tokenizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; returns RequestOutputs in input order.

        ``priority``: one per prompt, for an engine built with ``scheduling_policy="priority"``
        (lower values are scheduled first); a prompt dict may carry vLLM's ``"cache_salt"``.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base
        model), for an engine built with ``enable_lora=True``."""
        prompts = _as_list(prompts)
        default = self.get_default_sampling_params() if sampling_params is None else None
        params = [_final_only(p) for p in _per_prompt(sampling_params, SamplingParams, default, len(prompts),
                                                            "sampling_params")]
        ids = self._add_all(prompts, params, priorities=priority, loras=lora_request)
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: Sequence[int] | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (``out.outputs.embedding``), in input order; needs an engine
        built with ``runner="pooling"`` (``pooler_config`` sets the pooling and normalization)."""
        prompts = _as_list(prompts)
        params = [_pooling_for(p, "embed", None)
                  for p in _per_prompt(pooling_params, PoolingParams, PoolingParams(), len(prompts), "pooling_params")]
        ids = self._add_all(prompts, params, self.llm_engine.add_pooling_request, priorities=priority,
                            loras=lora_request)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             documents: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: applies the chat template (``chat_template``, else the tokenizer's)
        to each conversation, then generates.

        ``tools``, ``documents`` and ``chat_template_kwargs`` go to the tokenizer's
        ``apply_chat_template`` as transformers takes them; ``continue_final_message`` leaves the
        last (assistant) message open for the model to continue, and excludes
        ``add_generation_prompt``. ``chat_template_content_format``: "string" joins a message's
        text parts into one string (with newlines, as vLLM), "openai" passes the parts as they
        are, "auto" = "string". A vision-language model also takes ``image_url`` parts (``{"url":
        ...}``: data:, or file:// / http(s) where ``allowed_local_media_path`` / ``allowed_media_domains``
        allow) and ``image_pil`` parts (a PIL image), and a model that takes videos ``video_url`` parts
        (a video file, or vLLM's ``data:video/jpeg;base64,<frame>,<frame>,...``); under "string" each
        becomes the model's image (video) placeholder, and ``mm_processor_kwargs`` goes to its
        processor. ``lora_request`` as in ``generate``."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True and add_generation_prompt=True cannot be combined: the "
                             "first continues the last message, the second starts a new one; pass "
                             "add_generation_prompt=False")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        options = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools, documents=documents)
        extra = _template_kwargs(chat_template_kwargs, options)
        prompts = [self._chat_prompt(tok, conv, chat_template_content_format, mm_processor_kwargs, {**options, **extra})
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _chat_prompt(self, tok, conversation: list[dict], content_format: str, mm_processor_kwargs: dict | None,
                     options: dict) -> dict:
        """One conversation as a prompt: its token ids, or (with images) its text and images, which
        the model's processor tokenizes together (each placeholder expanded)."""
        multimodal = self.llm_engine.multimodal
        media = chat_media(conversation, self.llm_engine.model_config) if multimodal is not None else {}
        images = media.get("image", [])
        if not media:
            if mm_processor_kwargs is not None:
                raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r:.80} is not supported here: it needs "
                                 "image parts in the messages, for a vision-language model")
            messages = _content_as(conversation, content_format)
            return {"prompt_token_ids": _as_ids(tok.apply_chat_template(messages, tokenize=True, **options))}
        messages = _content_as(conversation, content_format, multimodal.placeholder, multimodal.video_placeholder)
        embeds = _parts_of(conversation, "image_embeds")
        if embeds and len(embeds) != len(images):
            raise ValueError("a conversation gives either images (image_url, image_pil) or image_embeds parts, "
                             "not both")
        prompt = {"prompt": tok.apply_chat_template(messages, tokenize=False, **options),
                  "multi_modal_data": {**media, **({"image": chat_embeds(embeds)} if embeds else {})},
                  "add_special_tokens": False}  # the template writes its own
        return {**prompt, "mm_processor_kwargs": mm_processor_kwargs} if mm_processor_kwargs is not None else prompt

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no sampling_params: the model's generation_config.json
        defaults (unless the engine was built with ``generation_config="vllm"``)."""
        return self.llm_engine.get_default_sampling_params()

    def _add_all(self, prompts, params, add: Callable | None = None,
                 priorities: Sequence[int] | None = None, loras=None) -> list[str]:
        """Queues every prompt with ``add`` (default ``add_request``); if one is refused, the
        ones already queued are aborted, so a bad prompt leaves nothing behind."""
        if priorities is not None and len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts; give one per prompt")
        engine = self.llm_engine
        add = add or engine.add_request
        loras = _per_prompt(_check_loras(loras), LoRARequest, None, len(prompts), "lora_request")
        ids = [str(next(self._counter)) for _ in prompts]
        added = []
        try:
            for rid, prompt, p, priority, lora in zip(ids, prompts, params, priorities or itertools.repeat(0), loras):
                add(rid, prompt, p, priority=priority, lora_request=lora)
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
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search as vLLM's ``LLM.beam_search``; beams share blocks via fork and copy-on-write.

        The searches run in the engine's ordinary steps, so requests already in flight keep
        running beside them (their outputs are not returned here).
        """
        engine = self.llm_engine
        prompts = _as_list(prompts)
        ids = self._add_all(prompts, [params] * len(prompts), engine.add_beam_search, loras=lora_request)

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

    # ------------------------------------------------------------------ pooling tasks (runner="pooling")
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               priority: Sequence[int] | None = None, pooling_task: str | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled result as a tensor (``out.outputs.data``), in input order:
        ``pooling_task`` "embed" (an embedding model's vector), "classify" (a classifier's class
        probabilities), "score" (a cross-encoder's relevance of a prompt already holding the
        pair), or per token, ``[prompt tokens, ...]``: "token_embed" (each position's normalized
        hidden state) or "token_classify" (each position's class probabilities); None: the
        model's own task."""
        check_task(pooling_task)
        prompts = _as_list(prompts)
        params = [_pooling_for(p, pooling_task, truncate_prompt_tokens)
                  for p in _per_prompt(pooling_params, PoolingParams, PoolingParams(), len(prompts), "pooling_params")]
        ids = self._add_all(prompts, params, self.llm_engine.add_pooling_request, priorities=priority,
                            loras=lora_request)
        return [_as_pooling_output(out) for out in self._run(ids, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType], *,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``out.outputs.probs``: softmax over the labels, sigmoid
        for one label; the logits with ``PoolingParams(use_activation=False)``), from a
        ``*ForSequenceClassification`` model run with ``runner="pooling"``."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, priority=priority, pooling_task="classify")
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data.tolist()),
                                            o.prompt_token_ids, o.finished) for o in outs]

    def reward(self, prompts: PromptType | Sequence[PromptType], *,
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, use_tqdm: bool = True,
               priority: Sequence[int] | None = None) -> list[PoolingRequestOutput]:
        """Per-token scores, as vLLM's ``reward`` (``pooling_task="token_classify"``): a
        ``*ForSequenceClassification`` model's head at every prompt position, through its
        activation; ``out.outputs.data`` is ``[prompt tokens, num_labels]``."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, priority=priority,
                           pooling_task="token_classify")

    def score(self, data_1: str | Sequence[str] | None = None, data_2: str | Sequence[str] | None = None, *,
              text_1: str | Sequence[str] | None = None, text_2: str | Sequence[str] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Scores text pairs, one ScoringRequestOutput per pair in ``data_2``'s order: one
        ``data_1`` text against every ``data_2`` text, or the two lists pairwise (vLLM's
        ``data_1``/``data_2``; its older names ``text_1``/``text_2`` are accepted too).

        A cross-encoder (a sequence classifier with one label) reads each pair as the tokenizer's
        text pair and scores it with its head (sigmoid, unless ``use_activation=False``); an
        embedding model scores the cosine similarity of the two texts' embeddings."""
        data_1 = _one_of(data_1, text_1, "data_1", "text_1")
        data_2 = _one_of(data_2, text_2, "data_2", "text_2")
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be one PoolingParams, got {type(pooling_params).__name__}")
        if self.llm_engine.model_config.is_classifier:
            return self._cross_encoder_scores(score_utils.pair_up(data_1, data_2), pooling_params,
                                              truncate_prompt_tokens, use_tqdm)
        return self._embedding_scores(data_1, data_2, pooling_params, truncate_prompt_tokens, use_tqdm)

    def _cross_encoder_scores(self, pairs, params, truncate, use_tqdm) -> list[ScoringRequestOutput]:
        tokenizer = self.get_tokenizer()
        prompts = [{"prompt_token_ids": score_utils.cross_encoder_ids(tokenizer, a, b)} for a, b in pairs]
        outs = self.encode(prompts, params, truncate_prompt_tokens=truncate, use_tqdm=use_tqdm, pooling_task="score")
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0].item()), o.prompt_token_ids,
                                     o.finished) for o in outs]

    def _embedding_scores(self, data_1, data_2, params, truncate, use_tqdm) -> list[ScoringRequestOutput]:
        texts_1, texts_2 = score_utils.as_texts(data_1, "data_1"), score_utils.as_texts(data_2, "data_2")
        score_utils.check_pair_counts(len(texts_1), len(texts_2))
        outs = self.encode(texts_1 + texts_2, params, truncate_prompt_tokens=truncate, use_tqdm=use_tqdm,
                           pooling_task="embed")
        outs_1, outs_2 = outs[:len(texts_1)], outs[len(texts_1):]
        scores = score_utils.embedding_scores([o.outputs.data for o in outs_1], [o.outputs.data for o in outs_2])
        firsts = score_utils.broadcast(outs_1, len(outs_2))
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(s),
                                     a.prompt_token_ids + b.prompt_token_ids)
                for a, b, s in zip(firsts, outs_2, scores)]
    # ------------------------------------------------------------------ sleep mode, RPC, profiling (RL loops)
    def sleep(self, level: int = 1) -> None:
        """Frees the KV pool and offloads the weights to host memory (level 1) or discards them
        (level 2), for an engine built with ``enable_sleep_mode=True``; no request may be
        unfinished. After level 2, ``wake_up()`` then load weights (``collective_rpc("load_weights",
        args=(weights,))`` or ``collective_rpc("reload_weights")``) before generating."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Brings back the weights and the KV pool (``tags``: None for both, or ``["weights"]`` /
        ``["kv_cache"]``, one after the other)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """Runs ``method`` on every rank's worker and returns the results in rank order: a method
        name (``"load_weights"`` with ``args=(weights,)``, ``weights`` an iterable of ``(name,
        tensor)`` full tensors with the checkpoint's names, or ``"update_weights"`` with a state
        dict; ``"reload_weights"``), or a callable taking the worker first (it reaches vLLM's
        ``worker.model_runner.model`` too)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def start_profile(self) -> None:
        """Starts the torch profiler on every rank (needs ``PAGEDLLM_TORCH_PROFILER_DIR`` or
        ``VLLM_TORCH_PROFILER_DIR``); ``stop_profile()`` writes the traces there."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()


def _final_only(params: SamplingParams) -> SamplingParams:
    """generate() returns finished outputs only, so the engine need not build partial ones."""
    params = params.clone()
    params.output_kind = "final_only"
    return params


def _refuse(value, name: str, why: str) -> None:
    if value is not None:
        raise ValueError(f"{name}={value!r} is not supported: {why}; pass None")


_CONTENT_FORMATS = ("auto", "string", "openai")


def _content_as(conversation: list[dict], content_format: str, image_placeholder: str | None = None,
                video_placeholder: str | None = None) -> list[dict]:
    """The messages with list contents joined into one string ("string", "auto") or kept ("openai").
    ``image_placeholder``: a vision-language model's image text, for its image parts (``video_placeholder``:
    its video text, for ``video_url`` parts)."""
    if content_format not in _CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format={content_format!r} must be one of {_CONTENT_FORMATS}")
    if content_format == "openai":
        return conversation
    return [{**m, "content": _joined_text(m["content"], i, image_placeholder, video_placeholder)}
            if isinstance(m.get("content"), list) else m for i, m in enumerate(conversation)]


def _joined_text(parts: list, i: int, image_placeholder: str | None = None,
                 video_placeholder: str | None = None) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _IMAGE_PARTS and image_placeholder is not None:
            texts.append(image_placeholder)
            continue
        if kind == "video_url" and video_placeholder is not None:
            texts.append(video_placeholder)
            continue
        if kind != "text":
            names = ["text", *(_IMAGE_PARTS if image_placeholder else ())]
            names += ["video_url"] if video_placeholder else []
            allowed = (f"{', '.join(names[:-1])} and {names[-1]} parts" if len(names) > 1
                       else "only text parts (text-only)")
            raise ValueError(f"messages[{i}].content has a {kind!r} part: {allowed} are supported")
        texts.append(part.get("text", ""))
    return "\n".join(texts)


_IMAGE_PARTS = ("image_url", "image_pil", "image_embeds")


def chat_media(conversation: list[dict], model_config) -> dict:
    """A conversation's ``multi_modal_data``: the images of its ``image_url`` / ``image_pil`` parts
    (PIL images) and ``image_embeds`` parts (as given), the videos of its ``video_url`` parts, in
    order; empty without any."""
    media: dict[str, list] = {}
    for i, message in enumerate(conversation):
        for part in message.get("content") if isinstance(message.get("content"), list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_pil", "image_embeds"):
                media.setdefault("image", []).append(part.get(kind))  # embeds: told apart by _chat_prompt
            elif kind in ("image_url", "video_url"):
                url = part.get(kind)
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"messages[{i}]: an {kind} part needs {kind}={{'url': ...}}")
                load = load_image if kind == "image_url" else load_video
                media.setdefault(kind.removesuffix("_url"), []).append(load(url, MediaPolicy.of(model_config)))
    return media


def _parts_of(conversation: list[dict], kind: str) -> list:
    """The values of a conversation's ``kind`` parts, in order."""
    return [part.get(kind) for message in conversation
            for part in (message.get("content") if isinstance(message.get("content"), list) else ())
            if isinstance(part, dict) and part.get("type") == kind]


def _template_kwargs(given: dict | None, options: dict) -> dict:
    """``chat_template_kwargs``: template variables; it may not repeat chat()'s own arguments."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {type(given).__name__}")
    clash = sorted(set(given) & (set(options) | {"conversation", "tokenize"}))
    if clash:
        raise ValueError(f"chat_template_kwargs repeats {clash}: pass them as chat()'s own arguments")
    return given


def _check_loras(given):
    """``lora_request``: None, one LoRARequest, or a list of them (None for the base model) per prompt."""
    ok = given is None or isinstance(given, LoRARequest) or (
        isinstance(given, (list, tuple)) and all(x is None or isinstance(x, LoRARequest) for x in given))
    if not ok:
        raise ValueError(f"lora_request={given!r:.80} is not supported: give a LoRARequest, or a list of one "
                         "(or None for the base model) per prompt")
    return given


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


def _pooling_for(params: PoolingParams, task: str | None, truncate_prompt_tokens: int | None) -> PoolingParams:
    """``params`` for ``task`` (a params object naming another task is a ValueError), with the
    call's ``truncate_prompt_tokens`` when given."""
    if not isinstance(params, PoolingParams):
        raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
    if task is not None and params.task not in (None, task):
        raise ValueError(f"pooling_params.task={params.task!r} disagrees with pooling_task={task!r}")
    changes = {"task": task or params.task}
    if truncate_prompt_tokens is not None:
        changes["truncate_prompt_tokens"] = truncate_prompt_tokens
    return dataclasses.replace(params, **changes)


def _as_pooling_output(out) -> PoolingRequestOutput:
    """The engine answers an embed request with an EmbeddingRequestOutput: encode returns vLLM's type."""
    if isinstance(out, PoolingRequestOutput):
        return out
    data = PoolingOutput(torch.tensor(out.outputs.embedding, dtype=torch.float32))
    return PoolingRequestOutput(out.request_id, data, out.prompt_token_ids, out.finished, out.metrics)


def _one_of(value, old, name: str, old_name: str):
    """vLLM's current argument ``name`` or its older spelling ``old_name``: exactly one of them."""
    if value is not None and old is not None:
        raise ValueError(f"{name} and {old_name} are the same argument (its older name): pass one")
    if value is None and old is None:
        raise TypeError(f"score() needs {name} (or its older name {old_name})")
    return value if value is not None else old
