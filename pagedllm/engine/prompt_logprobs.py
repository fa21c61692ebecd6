"""prompt_logprobs of one step: planned on the host, computed on the device, stored once fetched.

Row j of a chunk's prompt-logprob rows (position ``start + j``) scores prompt token
``start + j + 1``: its logprob and vocabulary rank plus the request's top-k (raw logits, like
vLLM). The device part returns tensors so the engine fetches them with the sampler's results in
its one device->host transfer (``contracts/device_to_host.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.contracts.host_to_device import to_device
from pagedllm.contracts.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class PromptLogprobPlan:
    """Which request owns which rows: ``(request, first position, row count)`` in row order,
    the token each row scores, and the largest top-k asked for."""

    owners: list[tuple]
    targets: list[int]
    top_k: int


def plan(sched_out: SchedulerOutput, requests: dict) -> PromptLogprobPlan | None:
    """None when no chunk of the step has prompt-logprob rows."""
    owners, targets = [], []
    for chunk in sched_out.chunks:
        if chunk.num_prompt_logprob_rows:
            req = requests[chunk.request_id]
            first = chunk.start + 1
            owners.append((req, first, chunk.num_prompt_logprob_rows))
            targets += req.all_token_ids[first:first + chunk.num_prompt_logprob_rows]
    if not owners:
        return None
    return PromptLogprobPlan(owners, targets, max(req.params.prompt_logprobs for req, _, _ in owners))


def host_arrays(p: PromptLogprobPlan | None) -> dict[str, np.ndarray]:
    """The rows' target token ids, to upload with the sampler's inputs (``Sampler.prepare``)."""
    return {} if p is None else dict(prompt_targets=np.array(p.targets, dtype=np.int64))


def device_tensors(logits: torch.Tensor, p: PromptLogprobPlan,
                   uploaded: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``prompt_chosen``/``prompt_ranks [rows]``, ``prompt_top_values``/``prompt_top_ids [rows, k]``;
    ``uploaded``: device tensors holding ``host_arrays(p)`` (None: uploaded here)."""
    targets = (uploaded or to_device(host_arrays(p), logits.device))["prompt_targets"]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, targets[:, None])  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_v, top_i = logprobs.topk(p.top_k, dim=-1) if p.top_k else (logprobs[:, :0], logprobs[:, :0].long())
    return dict(prompt_chosen=chosen.squeeze(1), prompt_ranks=ranks, prompt_top_values=top_v, prompt_top_ids=top_i)


def store(p: PromptLogprobPlan, host: dict[str, np.ndarray]) -> None:
    """Writes each row's entry into its request's ``prompt_logprobs``."""
    chosen, ranks = host["prompt_chosen"].tolist(), host["prompt_ranks"].tolist()
    top_v, top_i = host["prompt_top_values"].tolist(), host["prompt_top_ids"].tolist()
    row = 0
    for req, first, count in p.owners:
        k = req.params.prompt_logprobs
        for pos in range(first, first + count):
            entry = {p.targets[row]: (chosen[row], ranks[row])}
            for r in range(k):
                entry.setdefault(top_i[row][r], (top_v[row][r], r + 1))
            req.prompt_logprobs[pos] = entry
            row += 1
