"""One pipeline-parallel step on one rank: the step's batch split into micro-batches that flow
through the stages one after another, so stage ``s`` works on micro-batch ``m`` while stage
``s + 1`` works on ``m - 1``.

Why split one step's batch, and not vLLM's virtual engines (one scheduler per in-flight batch):
the split needs no change to the scheduler or the engine loop, every micro-batch shares one block
pool and one prefix cache (virtual engines split the pool, and their prefix hits, ``pp`` ways),
and the engine samples once per step as before. What it gives up: the stages idle while a step
fills and drains the pipeline, ``(pp - 1) / (m + pp - 1)`` of the step for ``m`` micro-batches,
and the engine's own work (schedule, sample, detokenize) does not overlap the forward.

Every rank runs the same split of the same SchedulerOutput (rank 0 sends the whole output to
all), so the ranks agree on each micro-batch's shape without exchanging it:

    rank 0 (stage 0):  fwd m0 ─send─▶ fwd m1 ─send─▶ ......... recv logits m0, m1
    stage 1 (last):          recv m0 ─ fwd m0 ─ logits─▶ recv m1 ─ fwd m1 ─ logits─▶
"""
from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.contracts.scheduler_output import ScheduledChunk, SchedulerOutput
from pagedllm.distributed.pipeline import PipelineGroup


def split_micro_batches(chunks: list[ScheduledChunk], max_batches: int) -> list[list[ScheduledChunk]]:
    """At most ``max_batches`` contiguous, non-empty groups of about equal token counts."""
    n = min(max_batches, len(chunks))
    tokens = np.cumsum([c.num_new_tokens for c in chunks])
    # group g ends after the first chunk whose running total reaches (g + 1) / n of the tokens
    ends = [int(np.searchsorted(tokens, tokens[-1] * (g + 1) / n)) + 1 for g in range(n - 1)]
    bounds, start = [], 0
    for g, end in enumerate(ends):
        end = min(max(end, start + 1), len(chunks) - (n - 1 - g))  # leave a chunk for every later group
        bounds.append((start, end))
        start = end
    bounds.append((start, len(chunks)))
    return [chunks[a:b] for a, b in bounds]


class StagePipeline:
    """Runs a step's micro-batches through this rank's stage (see the module docstring);
    ``max_in_flight`` is the most micro-batches one step has had."""

    def __init__(self, pp: PipelineGroup, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.pp = pp
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.dtype, self.device = dtype, device
        self.max_in_flight = 0

    def run(self, runner, out: SchedulerOutput) -> tuple[torch.Tensor, float]:
        """Rank 0: the step's logits ``[num_sample_rows + prompt rows, vocab]`` (sampling rows of
        every micro-batch first, as one forward orders them) and its input-preparation seconds;
        other ranks: empty logits."""
        batches = [SchedulerOutput(chunks=group) for group in split_micro_batches(out.chunks, self.pp.layout.pp_size)]
        self.max_in_flight = max(self.max_in_flight, len(batches))
        pending, prepare = [], 0.0
        for batch in batches:
            t0 = time.perf_counter()
            input_ids, positions, meta, logit_idx = runner.prepare_inputs(batch)
            prepare += time.perf_counter() - t0
            result = runner.forward_stage(input_ids, positions, meta, self._receive(batch.num_tokens))
            pending += self._hand_on(runner, result, logit_idx)
        logits = self._collect(batches) if self.pp.layout.rank == 0 else torch.empty(0, self.vocab_size)
        for work, _ in pending:
            work.wait()
        return logits, prepare

    def _receive(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The previous stage's ``(hidden, residual)``, each ``[num_tokens, hidden]``; None on the first."""
        if self.pp.is_first:
            return None
        pair = [torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device) for _ in range(2)]
        hidden, residual = self.pp.recv_hidden(pair)
        return hidden, residual

    def _hand_on(self, runner, result, logit_idx) -> list:
        """Starts the sends of one micro-batch's result; (work, tensor) pairs to wait on (the
        tensor is kept alive until its send completes)."""
        if not self.pp.is_last:
            tensors = [t.contiguous() for t in result]
            return list(zip(self.pp.send_hidden(tensors), tensors))
        logits = runner.compute_logits(result[logit_idx])  # [rows, vocab], on every TP rank of the stage
        if not self.pp.layout.sends_logits:
            return []
        logits = logits.to(self.dtype).contiguous()
        return [(self.pp.send_logits(logits), logits)]

    def _collect(self, batches: list[SchedulerOutput]) -> torch.Tensor:
        """The micro-batches' logits in one forward's row order: every sampling row, then every
        prompt-logprob row, then every speculative verify row (each micro-batch sends its own
        rows in that order)."""
        kinds = ([], [], [])  # sampling, prompt-logprob, verify rows
        for batch in batches:
            counts = (batch.num_sample_rows, batch.num_prompt_logprob_rows, batch.num_verify_rows)
            logits = self.pp.recv_logits(torch.empty(sum(counts), self.vocab_size, dtype=self.dtype,
                                                     device=self.device))
            for rows, part in zip(kinds, logits.split(counts), strict=True):
                rows.append(part)
        return torch.cat([part for rows in kinds for part in rows])
