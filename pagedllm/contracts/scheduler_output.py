"""What the scheduler hands the executor each step: ids and counts, never tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.contracts.tier_ops import TierOps
from pagedllm.lora.request import LoRARequest


@dataclass(frozen=True)
class EncoderInput:
    """An image the worker encodes this step; its embeddings stay in the worker's encoder cache
    under ``hash`` until the scheduler frees them (``SchedulerOutput.encoder_frees``)."""

    hash: bytes
    data: dict[str, torch.Tensor] = field(repr=False)


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of one request, starting at context position ``start``."""

    request_id: str
    token_ids: list[int]  # the tokens to compute: all_token_ids[start : start + num_new_tokens]
    start: int
    # the request's block table after allocation, as an update of the runner's persistent copy:
    # entries [0, new_block_start) are unchanged since the request's previous chunk (or its
    # table was released and new_block_start is 0), new_block_ids replace entries from there on
    new_block_start: int
    new_block_ids: list[int]
    num_samples: int  # 0 while prefilling a chunk that does not reach the last token; n on a fork
    # prompt_logprobs: logits are also needed at the chunk's first k positions (each predicts
    # the prompt token after it)
    num_prompt_logprob_rows: int = 0
    # speculative decoding: the last k token_ids are drafts (num_samples is 0); logits come back
    # at the chunk's last k + 1 positions, after every sampling and prompt-logprob row
    num_spec_tokens: int = 0
    # images whose placeholder runs the chunk covers, as (content hash, offset in the prompt, length):
    # their rows of the worker's encoder cache replace the placeholders' token embeddings
    mm_spans: tuple[tuple[bytes, int, int], ...] = ()
    # LongRoPE: the request rotates with the long factors (its positions are offset into the rotary
    # table's long half, layers/rotary_variants.py)
    long_rope: bool = False
    # M-RoPE requests (multimodal/mrope.py): the tokens' (t, h, w) positions [3, num_new_tokens]
    mrope_positions: np.ndarray | None = field(default=None, compare=False)
    lora_slot: int = -1  # the adapter slot its tokens run with (-1: the base model)
    # bidirectional image runs (Gemma 3): each token's visible end [num_new_tokens], attention/metadata.py
    attend_ends: np.ndarray | None = field(default=None, compare=False)

    @property
    def num_verify_rows(self) -> int:
        return self.num_spec_tokens + 1 if self.num_spec_tokens else 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return self.new_block_start + len(self.new_block_ids)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before forward
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    preempted_ids: list[str] = field(default_factory=list)
    # requests whose block tables were dropped since the previous output (finished, aborted,
    # preempted, swapped out): the runner forgets their persistent rows before this step
    released_ids: list[str] = field(default_factory=list)
    tier_ops: TierOps | None = None  # KV tier moves and loads (kv_cache/offload/), before forward
    return_hidden: bool = False  # runner="pooling": hand back the hidden rows logits come from
    # MEAN / CLS pooling: (first token row in the step's batch, rows) per span to sum (ExecuteResult.span_sums)
    pool_spans: list[tuple[int, int]] = field(default_factory=list)
    # per-token pooling tasks: (first token row, rows) per span handed back row by row (ExecuteResult.span_rows)
    pool_rows: list[tuple[int, int]] = field(default_factory=list)
    # adapters to write into their device slots before forward (lora/slot_pool.py)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # multimodal: images to encode before this step's forward (their pixels travel once, here), and
    # encoder-cache entries the worker drops first (multimodal/encoder_cache.py)
    encoder_inputs: list[EncoderInput] = field(default_factory=list)
    encoder_frees: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def num_sample_rows(self) -> int:
        return sum(c.num_samples for c in self.chunks)

    @property
    def num_prompt_logprob_rows(self) -> int:
        return sum(c.num_prompt_logprob_rows for c in self.chunks)

    @property
    def num_verify_rows(self) -> int:
        return sum(c.num_verify_rows for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing for the executor: no tokens, no cache plans, no persistent rows to forget."""
        return not (self.chunks or self.blocks_to_swap_out or self.blocks_to_copy or self.released_ids
                    or self.tier_ops or self.encoder_frees or self.lora_loads)
