"""A sampling step's per-row inputs, gathered on the host and sent to the device in one copy.

The sampler's rules read per-row parameters (temperature, top-k/p, min-p, penalties), index
lists (allowed ids, logit bias, bad words, banned ids), histories (penalties), the grammar
bitmask and the seeded rows' noise. Every choice that depends on them ("does any row use
top-p?") is made here from the Python values, never by reading a device tensor back, and the
arrays travel in one ``to_device`` call (pinned, non-blocking on CUDA). A rule that no row
uses gets no arrays and costs no kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from pagedllm.contracts.host_to_device import to_device
from pagedllm.layers.penalty_history import PenaltyHistory, pad_token_lists


@dataclass(frozen=True)
class SamplingFlags:
    """Which rules the step needs, decided on the host."""

    all_greedy: bool
    need_logprobs: bool  # some row reports logprobs or ranks by them (best_of)
    max_top_logprobs: int  # the largest ``params.logprobs`` (0: no top-logprobs)
    allowed: bool = False
    bias: bool = False
    masked: bool = False  # bad words or banned ids
    penalties: bool = False
    repetition: bool = False
    top_k_top_p: bool = False
    min_p: bool = False
    grammar: bool = False
    seeded: bool = False


@dataclass
class SamplingInputs:
    """``flags`` plus the device tensors, by the names of ``build_host_arrays``."""

    flags: SamplingFlags
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def prepare_inputs(rows: list, vocab: int, device: torch.device, bitmask: np.ndarray | None = None,
                   noise: bool = True, history: PenaltyHistory | None = None,
                   extra: dict[str, np.ndarray] | None = None) -> SamplingInputs:
    """``rows``: the sampler's ``SamplingRow``s; ``bitmask``: the grammar's (``fill_bitmask``);
    ``noise``: draw seeded rows' sampling noise from their generators (False when nothing is
    drawn from these inputs: the generators must not advance); ``history``: the penalties' token
    histories kept on the device between steps (None: every history uploaded whole); ``extra``:
    the caller's own arrays, uploaded in the same copy (names must not clash with the inputs')."""
    flags = sampling_flags(rows, vocab, bitmask is not None, noise)
    with_history = flags.penalties and history is not None
    arrays = build_host_arrays(rows, vocab, flags, histories=not with_history)
    if bitmask is not None:
        arrays["bitmask"] = bitmask
    if with_history:  # the new tokens (or a rebuild) travel in the step's one upload
        arrays.update(history.host_arrays(rows, flags.repetition))
    if extra:
        assert not arrays.keys() & extra.keys(), f"extra arrays {sorted(arrays.keys() & extra.keys())} clash"
        arrays.update(extra)
    tensors = to_device(arrays, device)
    if with_history:
        tensors.update(history.device_tensors(tensors))
    return SamplingInputs(flags, tensors)


def sampling_flags(rows: list, vocab: int, grammar: bool, noise: bool = True) -> SamplingFlags:
    p = [r.params for r in rows]
    ks = [x.logprobs or 0 for x in p]
    return SamplingFlags(
        all_greedy=all(x.greedy for x in p),
        need_logprobs=any(x.logprobs is not None or (x.best_of or 0) > x.n for x in p),
        max_top_logprobs=max(ks, default=0),
        allowed=any(x.allowed_token_ids for x in p), bias=any(x.logit_bias for x in p),
        masked=any(r.banned_token_ids or r.params.bad_words_token_ids for r in rows),
        penalties=any(x.presence_penalty != 0 or x.frequency_penalty != 0 or x.repetition_penalty != 1 for x in p),
        repetition=any(x.repetition_penalty != 1 for x in p),
        top_k_top_p=any(0 < x.top_k < vocab or x.top_p < 1 for x in p),
        min_p=any(x.min_p > 0 for x in p), grammar=grammar,
        seeded=noise and not all(x.greedy for x in p) and any(r.generator is not None for r in rows))


def build_host_arrays(rows: list, vocab: int, flags: SamplingFlags, histories: bool = True) -> dict[str, np.ndarray]:
    """The arrays of the rules ``flags`` turns on (the penalties' token histories only with
    ``histories``; otherwise a ``PenaltyHistory`` supplies them)::

        temperature, top_k, top_p, min_p, greedy        [rows]     (random rows only)
        allowed_rows [rows] bool, allowed_pairs [2, n]  (row, token) a row may sample
        bias_pairs [2, n], bias_values [n]              logit_bias entries
        masked_pairs [2, n]                             (row, token) set to -inf: bad words, banned ids
        repetition/frequency/presence [rows], output_ids/output_mask [rows, w], prompt_* likewise
        seeded_rows [s], seeded_noise [s, vocab]        Exp(1) draws from each seeded row's generator
    """
    arrays: dict[str, np.ndarray] = {}
    if not flags.all_greedy:
        arrays.update(_random_params(rows, vocab))
    if flags.allowed:
        arrays.update(_allowed(rows))
    if flags.bias:
        arrays.update(_bias(rows))
    if flags.masked:
        arrays["masked_pairs"] = _pairs(_masked_tokens(rows))
    if flags.penalties:
        arrays.update(_penalties(rows, flags.repetition, histories))
    if flags.seeded:
        arrays.update(_seeded_noise(rows, vocab))
    return arrays


def _random_params(rows: list, vocab: int) -> dict[str, np.ndarray]:
    p = [r.params for r in rows]
    return dict(temperature=np.array([max(x.temperature, 1e-5) for x in p], dtype=np.float32),
                top_k=np.array([x.top_k if x.top_k > 0 else vocab for x in p], dtype=np.int64),
                top_p=np.array([x.top_p for x in p], dtype=np.float32),
                min_p=np.array([x.min_p for x in p], dtype=np.float32),
                greedy=np.array([x.greedy for x in p], dtype=np.bool_))


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    """``[2, n]`` int64: row indices, then column indices."""
    return np.array(pairs, dtype=np.int64).reshape(-1, 2).T.copy()


def _row_pairs(lists: list) -> np.ndarray:
    """``[2, n]`` int64 (row, item) pairs of per-row id collections (None or empty: none),
    built without a per-item tuple: each row index repeated by its length, the items chained."""
    lengths = np.fromiter((len(x) if x else 0 for x in lists), dtype=np.int64, count=len(lists))
    total = int(lengths.sum())
    pairs = np.empty((2, total), dtype=np.int64)
    pairs[0] = np.repeat(np.arange(len(lists), dtype=np.int64), lengths)
    pairs[1] = np.fromiter(chain.from_iterable(x for x in lists if x), dtype=np.int64, count=total)
    return pairs


def _allowed(rows: list) -> dict[str, np.ndarray]:
    ids = [r.params.allowed_token_ids for r in rows]
    return dict(allowed_rows=np.array([bool(x) for x in ids], dtype=np.bool_),
                allowed_pairs=_row_pairs(ids))


def _bias(rows: list) -> dict[str, np.ndarray]:
    biases = [r.params.logit_bias for r in rows]
    total = sum(len(b) for b in biases if b)
    return dict(bias_pairs=_row_pairs(biases),  # a dict iterates its keys: the token ids
                bias_values=np.fromiter(chain.from_iterable(b.values() for b in biases if b),
                                        dtype=np.float32, count=total))


def _masked_tokens(rows: list) -> list[tuple[int, int]]:
    """Every (row, token) that may not be sampled: bad words and min_tokens' banned ids."""
    pairs = bad_word_hits(rows)
    pairs += [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
    return pairs


def bad_word_hits(rows: list) -> list[tuple[int, int]]:
    """vLLM's bad_words: a word's last token is masked when the output already ends with the
    word's other tokens (a one-token word: always). Returns (row, token) pairs."""
    hits = []
    for i, row in enumerate(rows):
        ids, num_output = row.token_ids, len(row.token_ids) - row.num_prompt_tokens
        for word in row.params.bad_words_token_ids or ():  # the word's prefix vs the output's tail
            k = len(word) - 1
            if k == 0 or (k <= num_output and ids[-k:] == word[:-1]):
                hits.append((i, word[-1]))
    return hits


def _pad(lists: list[list[int]], prefix: str) -> dict[str, np.ndarray]:
    """Right-padded token matrix ``[rows, width]`` and its validity mask, named by ``prefix``."""
    ids, mask = pad_token_lists(lists)
    return {f"{prefix}_ids": ids, f"{prefix}_mask": mask}


def _penalties(rows: list, repetition: bool, histories: bool) -> dict[str, np.ndarray]:
    p = [r.params for r in rows]
    arrays = dict(frequency=np.array([x.frequency_penalty for x in p], dtype=np.float32),
                  presence=np.array([x.presence_penalty for x in p], dtype=np.float32))
    if histories:
        arrays.update(_pad([r.output_token_ids for r in rows], "output"))
    if repetition:
        arrays["repetition"] = np.array([x.repetition_penalty for x in p], dtype=np.float32)
    if repetition and histories:
        arrays.update(_pad([r.prompt_token_ids for r in rows], "prompt"))
    return arrays


def _seeded_noise(rows: list, vocab: int) -> dict[str, np.ndarray]:
    """Each seeded row's Exp(1) draws, from its own generator on the host (so its tokens do not
    depend on the rest of the batch), written straight into the array that is uploaded. A seeded
    greedy row in a batch with random rows draws too (and discards it), as before this module."""
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    noise = np.empty((len(seeded), vocab), dtype=np.float32)
    for j, i in enumerate(seeded):
        torch.from_numpy(noise[j]).exponential_(generator=rows[i].generator)
    return dict(seeded_rows=np.array(seeded, dtype=np.int64), seeded_noise=noise)
