"""Vectorized sampler: one pass over ``[num_rows, vocab]`` logits with per-row parameters.

Order: raw log-probs (reported, as vLLM's default) -> the structured-output grammar's bitmask
(constrained rows only) -> allowed_token_ids and logit_bias -> bad_words -> min_tokens masking -> penalties ->
greedy rows take argmax; random rows apply temperature, top-k, top-p, min-p and draw with the
exponential-race trick ``argmax(p / q), q ~ Exp(1)``, where seeded rows draw ``q`` from their
own generator so their tokens do not depend on the rest of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.ops import check_layer_ops
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarState, StructuredOutputManager


@dataclass
class SamplingRow:
    """One row to sample: a sequence's parameters, history and generator."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output, the sequence's own list (not copied per step)
    num_prompt_tokens: int
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # eos/stop ids masked until min_tokens is reached
    grammar: GrammarState | None = None  # structured_outputs: only tokens it allows may be sampled

    # the slices are taken only by the penalties, the one place that needs the history
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each sampled token
    top_logprobs: list[dict[int, float]] | None  # per row: top-k token -> logprob (k = params.logprobs)


class Sampler:
    """Samples one token per row. ``ops="triton"`` (layers/ops.py) filters top-k/top-p/min-p with
    the Triton kernel (no sort, no host sync); otherwise with the sorting torch code below.
    ``structured_output`` applies the grammar bitmasks."""

    def __init__(self, ops: str = "native", structured_output: StructuredOutputManager | None = None):
        self.ops = check_layer_ops(ops)
        self.structured_output = structured_output

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()  # [num_rows, vocab]
        # log-probs are only computed when some row reports them or ranks by them (best_of)
        need_lp = any(r.params.logprobs is not None or (r.params.best_of or 0) > r.params.n for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if need_lp else None
        logits = self._process(logits, rows)
        tokens = self._choose(logits, rows)
        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist(), [0.0] * len(rows), None)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        return SamplerOutput(tokens.tolist(), chosen.tolist(), _top_logprobs(raw_logprobs, rows))

    @torch.inference_mode()
    def distributions(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, raw_logprobs)``, both ``[num_rows, vocab]``: the normalised distribution
        ``__call__`` draws each row's token from (a greedy row: one-hot at its argmax) and the
        raw log-probs it reports. Speculative decoding verifies drafts against these."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._process(logits, rows)
        probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).float()  # [rows, vocab]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random:
            weights = _random_probs(logits[random], [rows[i] for i in random])
            probs[random] = weights / weights.sum(dim=-1, keepdim=True)
        return probs, raw_logprobs

    @staticmethod
    def top_logprobs(raw_logprobs: torch.Tensor, rows: list[SamplingRow]) -> list[dict[int, float]] | None:
        """Per row, its ``params.logprobs`` most likely tokens -> raw logprob (None if no row asks)."""
        return _top_logprobs(raw_logprobs, rows)

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Every logit rule before the draw (grammar, allowed ids and bias, bad words, min_tokens, penalties)."""
        self._apply_grammars(logits, rows)
        logits = _apply_allowed_and_bias(logits, rows)
        logits = _mask_bad_words(logits, rows)
        logits = _mask_banned(logits, rows)
        return _apply_penalties(logits, rows)

    def _apply_grammars(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        grammars = [r.grammar for r in rows]
        if any(g is not None for g in grammars):
            if self.structured_output is None:
                raise ValueError("rows carry grammars but this Sampler has no StructuredOutputManager")
            self.structured_output.apply_bitmask(logits, grammars)

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        flags = [r.params.greedy for r in rows]
        if all(flags):
            return tokens
        greedy = torch.tensor(flags, device=logits.device)
        sampled = _sample_random(logits, rows) if self.ops == "native" else _sample_random_triton(logits, rows)
        return torch.where(greedy, tokens, sampled)


def _param_tensor(rows, attr: str, device, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([getattr(r.params, attr) for r in rows], device=device, dtype=dtype)


def _apply_allowed_and_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Masks every token outside a row's ``allowed_token_ids``, then adds its ``logit_bias``
    (one scatter for the whole batch)."""
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids]
    if allowed:
        keep = torch.zeros(len(allowed), logits.shape[1], dtype=torch.bool, device=logits.device)
        for j, (_, ids) in enumerate(allowed):
            keep[j, ids] = True
        idx = torch.tensor([i for i, _ in allowed], device=logits.device)
        logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if biased:
        row_idx = torch.tensor([i for i, b in biased for _ in b], device=logits.device)
        col_idx = torch.tensor([t for _, b in biased for t in b], device=logits.device)
        values = torch.tensor([v for _, b in biased for v in b.values()], dtype=logits.dtype, device=logits.device)
        logits.index_put_((row_idx, col_idx), values, accumulate=True)
    return logits


def _mask_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's bad_words: a word's last token is masked when the output already ends with the
    word's other tokens (a one-token word: always)."""
    hit_rows, hit_tokens = [], []
    for i, row in enumerate(rows):
        words = row.params.bad_words_token_ids
        if not words:
            continue
        ids, num_output = row.token_ids, len(row.token_ids) - row.num_prompt_tokens
        for word in words:  # compares only the word's prefix with the output's tail (no history copy)
            k = len(word) - 1
            if k == 0 or (k <= num_output and ids[-k:] == word[:-1]):
                hit_rows.append(i)
                hit_tokens.append(word[-1])
    if hit_rows:  # one indexed write for the batch, not one per masked token
        dev = logits.device
        logits[torch.tensor(hit_rows, device=dev), torch.tensor(hit_tokens, device=dev)] = float("-inf")
    return logits


def _mask_banned(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, row in enumerate(rows):
        if row.banned_token_ids:
            logits[i, list(row.banned_token_ids)] = float("-inf")
    return logits


def _pad(lists: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token matrix and its validity mask."""
    width = max(1, max(len(x) for x in lists))
    ids = torch.zeros(len(lists), width, dtype=torch.long)
    mask = torch.zeros(len(lists), width, dtype=torch.bool)
    for i, x in enumerate(lists):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : len(x)] = True
    return ids.to(device), mask.to(device)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    p = [r.params for r in rows]
    if all(x.presence_penalty == 0 and x.frequency_penalty == 0 and x.repetition_penalty == 1 for x in p):
        return logits
    dev = logits.device
    out_ids, out_mask = _pad([r.output_token_ids for r in rows], dev)
    counts = torch.zeros_like(logits).scatter_add_(1, out_ids, out_mask.float())  # [rows, vocab]
    rep = _param_tensor(rows, "repetition_penalty", dev)[:, None]
    if bool((rep != 1).any()):
        prompt_ids, prompt_mask = _pad([r.prompt_token_ids for r in rows], dev)
        seen = torch.zeros_like(logits).scatter_add_(1, prompt_ids, prompt_mask.float()) + counts > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - _param_tensor(rows, "frequency_penalty", dev)[:, None] * counts
    return logits - _param_tensor(rows, "presence_penalty", dev)[:, None] * (counts > 0).float()


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    probs = _random_probs(logits, rows)
    return (probs / _exponential_noise(probs, rows)).argmax(dim=-1)


def _random_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: each row's weights to draw from (not normalised after min-p)."""
    dev = logits.device
    temp = _param_tensor(rows, "temperature", dev).clamp_min(1e-5)[:, None]
    logits = logits / temp
    logits = _top_k_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    min_p = _param_tensor(rows, "min_p", dev)
    if bool((min_p > 0).any()):
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
    return probs


def _sample_random_triton(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``_sample_random`` with the top-k/top-p/min-p filter in one kernel: the per-row parameters
    travel in one host->device copy and nothing is read back before the draw."""
    from pagedllm.layers.triton_ops.sampling import top_k_top_p_min_p_
    params = _filter_params(rows, logits.shape[1], logits.device)  # [4, rows]: temperature, top-k, top-p, min-p
    logits = (logits / params[0, :, None]).contiguous()
    top_k = params[1].to(torch.int32)  # exact: token counts are far below 2^24
    top_k_top_p_min_p_(logits, top_k, params[2].contiguous(), params[3].contiguous())
    probs = torch.softmax(logits, dim=-1)
    return (probs / _exponential_noise(probs, rows)).argmax(dim=-1)


def _filter_params(rows: list[SamplingRow], vocab: int, device: torch.device) -> torch.Tensor:
    """``[4, rows]`` float32 on ``device``: temperature (clamped like ``_sample_random``), top_k
    (0 = off), top_p, min_p."""
    host = torch.tensor([[max(r.params.temperature, 1e-5) for r in rows],
                         [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows],
                         [r.params.top_p for r in rows], [r.params.min_p for r in rows]], dtype=torch.float32)
    if device.type != "cuda":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=torch.float32, pin_memory=True)  # cached by torch's host allocator
    return pinned.copy_(host).to(device, non_blocking=True)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=dev)
    top_p = _param_tensor(rows, "top_p", dev)
    if bool((top_k >= vocab).all()) and bool((top_p >= 1).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # the top token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_()
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if seeded:  # drawn on the host from each row's own generator, copied to the device at once
        draws = [torch.empty(probs.shape[1]).exponential_(generator=rows[i].generator) for i in seeded]
        q[torch.tensor(seeded, device=probs.device)] = torch.stack(draws).to(probs.device)
    return q


def _top_logprobs(raw: torch.Tensor, rows: list[SamplingRow]) -> list[dict[int, float]] | None:
    ks = [r.params.logprobs or 0 for r in rows]
    if max(ks) == 0:
        return None
    values, ids = raw.topk(max(ks), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [dict(zip(ids[i][:k], values[i][:k])) for i, k in enumerate(ks)]
