"""CUDA graphs for decode steps: one captured model forward per batch size, replayed.

A decode step of a small model on a fast GPU is dominated by kernel launches (16 layers x ~12
kernels, each ~5 us to launch, against a few us of work). Capturing the forward once per batch
size and replaying it launches the whole step at once. What is captured:

- batch sizes ``1, 2, 4, 8, 16, 24, 32, ...`` (step 8 after 8, like vLLM) up to the first size
  >= ``max_num_seqs``; a decode-only step of ``n`` sequences runs the graph of the smallest
  size >= n, its rows ``n..size-1`` being padding
- the model forward only (embedding through the final norm); the LM head and the sampler run
  eagerly on the rows to sample

Inputs live in persistent device buffers, sized for the largest graph (a smaller graph reads their
leading rows); the step's single host->device copy (``host_to_device.to_device(out=...)``)
writes into them. Padding rows must not touch any sequence's KV, so they point at one extra
*padding block*, allocated past the blocks the scheduler owns::

    row:           0 .. n-1 (real)             n .. size-1 (padding)
    seq_lens:      real                        1
    block_tables:  real (stale past the end)   [pad_block, ...]
    slot_mapping:  real                        pad_block * block_size

Under tensor parallelism (``PAGEDLLM_TP_CUDA_GRAPHS=1``) every rank captures its own graphs,
with the all-reduces of its row-parallel layers inside them. Each rank receives the same
SchedulerOutput and fills its own buffers from it, outside the graph (there is no tensor
broadcast to capture), so the replay decision and the padding are the same pure function of the
step on every rank; ``agree_on_schedule`` checks at start-up that every rank will capture the
same sizes in the same order, since a rank replaying a different graph would pair its collectives
with the wrong ones. The LM head's all-gather runs eagerly after the replay.

With LoRA (``enable_lora``) the graphs are captured in ``LoRABatch``'s graph-safe mode: two more
persistent buffers hold the step's token -> adapter mapping as ``layers/lora.slot_groups`` lays it
out (``lora_perm [size]``: every row, grouped by slot, the base and padding rows last;
``lora_seg_start [max_loras + 1]``), filled by the same single copy, and every projection's
kernels run over all ``max_loras`` segments with grids fixed by the graph's size, so any mix of
adapters and base requests replays the one graph of its size. Padding rows map to no adapter.
The adapters' weights are read from the slot tensors, which a load overwrites in place.

The captured metadata says ``max_seq_len = max_model_len`` and ``max_query_len = 1``: a
graph-safe backend (``AttentionBackend.supports_cuda_graphs``) reads lengths from the tensors and
uses the host maxima only as upper bounds, and never synchronises with the host.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.contracts.host_to_device import to_device
from pagedllm.layers.lora import LoRABatch, slot_groups
from pagedllm.utils import human_bytes

logger = logging.getLogger(__name__)

GRAPH_INPUTS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")
WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles, cuBLAS picks algorithms, lazy inits


def capture_sizes(max_num_seqs: int) -> list[int]:
    """``1, 2, 4, 8, 16, 24, ...`` up to the first size >= ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be >= 1")
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 8 else sizes[-1] + 8)
    return sizes


def replay_size(sizes: list[int], host: dict[str, np.ndarray]) -> int | None:
    """The graph size a step runs at: decode-only (one new token per sequence) and no more
    sequences than the largest graph; None: run eagerly."""
    qsl = host["query_start_loc"]  # [num_reqs + 1]
    num_reqs = len(qsl) - 1
    if num_reqs < 1 or num_reqs > sizes[-1] or not np.all(np.diff(qsl) == 1):
        return None
    return sizes[bisect.bisect_left(sizes, num_reqs)]


def agree_on_schedule(tp, schedule: list[int], device: torch.device) -> None:
    """Raises RuntimeError on every rank of ``tp`` unless all passed the same ``schedule``
    (``DecodeGraphs.schedule()``, or [] for a rank that captures nothing). Collective: every rank
    calls it at the same point of start-up."""
    if tp.size == 1:
        return
    lengths = [row[0] for row in tp.gather_ints([len(schedule)], device)]
    rows = tp.gather_ints(schedule, device) if len(set(lengths)) == 1 else [[n] for n in lengths]
    if any(row != rows[0] for row in rows):
        raise RuntimeError(f"tensor-parallel ranks disagree on the CUDA-graph capture schedule "
                           f"([pad_block, max_blocks_per_seq, sizes in capture order] per rank): {rows}")


def pad_decode_inputs(host: dict[str, np.ndarray], size: int, pad_block: int, block_size: int) -> dict[str, np.ndarray]:
    """The step's graph inputs padded to ``size`` rows (layout in the module docstring); other
    arrays (e.g. ``sample_idx``) pass through unchanged."""
    n = len(host["seq_lens"])
    pad = size - n
    padded = dict(host)
    for name, fill in (("input_ids", 0), ("positions", 0), ("slot_mapping", pad_block * block_size), ("seq_lens", 1)):
        padded[name] = np.concatenate([host[name], np.full(pad, fill, dtype=host[name].dtype)])
    padded["query_start_loc"] = np.arange(size + 1, dtype=host["query_start_loc"].dtype)
    tables = host["block_tables"]
    pad_rows = np.full((pad, tables.shape[1]), pad_block, dtype=tables.dtype)
    padded["block_tables"] = np.concatenate([tables, pad_rows])  # [size, width]
    return padded


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache, one per batch size.

    ``capture`` records them (largest first, sharing one memory pool); ``prepare`` fills the
    persistent inputs for a step that ``replay_size`` accepts and returns what the runner needs;
    ``replay`` runs the graph and returns its hidden states ``[size, hidden]``, valid until the
    next replay. ``lora``: the model's shared ``LoRABatch`` (with ``enable_lora``); ``prepare``
    puts it in graph-safe mode over the LoRA buffers, filled from its ``token_slots``.
    """

    def __init__(self, sizes: list[int], max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 pad_block: int, device: torch.device, lora: LoRABatch | None = None):
        self.sizes, self.block_size, self.pad_block = sizes, block_size, pad_block
        self.max_model_len, self.device = max_model_len, device
        self.replays = 0  # steps served by a graph (tests and logs read it)
        self.memory_bytes = 0  # device memory the captures took (graph pool + graph objects)
        n = sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.buffers = dict(  # the padding layout, so a capture never touches a real block
            input_ids=torch.zeros(n, **i64), positions=torch.zeros(n, **i64),
            slot_mapping=torch.full((n,), pad_block * block_size, **i64), seq_lens=torch.ones(n, **i32),
            query_start_loc=torch.arange(n + 1, **i32),
            block_tables=torch.full((n, max_blocks_per_seq), pad_block, **i32))
        self.lora = lora
        if lora is not None:  # every row a base row until a step fills them
            if not lora.num_slots:
                raise ValueError(f"LoRABatch.num_slots={lora.num_slots!r}: the graph buffers need max_loras >= 1")
            self.buffers.update(lora_perm=torch.arange(n, **i64), lora_seg_start=torch.zeros(lora.num_slots + 1, **i64))
            self._lora_seg_slot = torch.arange(lora.num_slots, **i64)  # segment s is slot s, always
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._metas = {size: self._metadata(size) for size in sizes}  # the one per size, captured and reused

    def _metadata(self, size: int) -> AttentionMetadata:
        """What a graph of ``size`` rows is captured with: views of the buffers."""
        b = self.buffers
        return AttentionMetadata(
            query_start_loc=b["query_start_loc"][: size + 1], seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size], slot_mapping=b["slot_mapping"][:size],
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size)

    def capture_order(self) -> list[int]:
        """Largest first: the smaller graphs fit in its pool."""
        return list(reversed(self.sizes))

    def schedule(self) -> list[int]:
        """What every tensor-parallel rank must capture identically (``agree_on_schedule``)."""
        return [self.pad_block, self.buffers["block_tables"].shape[1], *self.capture_order()]

    @torch.inference_mode()
    def capture(self, model: torch.nn.Module, kv_caches: list) -> None:
        """Captures every size; logs (and keeps in ``memory_bytes``) the time and memory taken."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in self.capture_order():
            self.memory_bytes += self._capture_one(model, kv_caches, size, pool)
        logger.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.2f s, %s of device memory",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - t0, human_bytes(self.memory_bytes))

    def _capture_one(self, model, kv_caches: list, size: int, pool) -> int:
        meta = self._metas[size]
        args = (self.buffers["input_ids"][:size], self.buffers["positions"][:size], kv_caches, meta)
        self._use_lora_buffers(size)
        for _ in range(WARMUP_RUNS):
            model(*args)
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._outputs[size] = model(*args)  # [size, hidden], lives in the pool
        torch.cuda.synchronize(self.device)
        self._graphs[size] = graph
        return max(0, free_before - torch.cuda.mem_get_info(self.device)[0])

    def prepare(self, host: dict[str, np.ndarray], size: int):
        """Pads the step to ``size`` rows and copies it into the buffers (one host->device copy).
        Returns ``(input_ids, positions, meta, sample_idx)`` like the eager path; ``meta`` is the
        graph's own (views of the buffers), which ``holds`` recognises."""
        padded = pad_decode_inputs(host, size, self.pad_block, self.block_size)
        width = padded["block_tables"].shape[1]
        views = {name: self.buffers[name][:size] for name in GRAPH_INPUTS if name != "query_start_loc"}
        views["query_start_loc"] = self.buffers["query_start_loc"][: size + 1]
        views["block_tables"] = self.buffers["block_tables"][:size, :width]  # later columns: stale, unread
        if self.lora is not None:
            padded["lora_perm"], padded["lora_seg_start"] = self._lora_mapping(len(host["input_ids"]), size)
            views.update(lora_perm=self.buffers["lora_perm"][:size], lora_seg_start=self.buffers["lora_seg_start"])
        dev = to_device(padded, self.device, out=views)
        self._use_lora_buffers(size)
        return dev["input_ids"], dev["positions"], self._metas[size], dev["sample_idx"]

    def _lora_mapping(self, num_tokens: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's token slots (``LoRABatch.token_slots``, set by the runner for this step's
        ``num_tokens`` rows) padded with base rows to ``size``, as ``(lora_perm, lora_seg_start)``."""
        slots = self.lora.token_slots
        if len(slots) != num_tokens:
            raise RuntimeError(f"LoRABatch.token_slots has {len(slots)} rows, the step {num_tokens}: it was not set "
                               "for this step")
        padded = np.concatenate([slots, np.full(size - len(slots), -1, dtype=np.int64)])
        return slot_groups(padded, self.lora.num_slots)

    def _use_lora_buffers(self, size: int) -> None:
        """The LoRA ops of the next forward (capture or replay of ``size`` rows) read the buffers."""
        if self.lora is not None:
            self.lora.use_graph(self.buffers["lora_perm"][:size], self._lora_seg_slot, self.buffers["lora_seg_start"])

    def holds(self, meta: AttentionMetadata) -> bool:
        """Whether ``meta`` is a graph's own (i.e. came from ``prepare``)."""
        return self._metas.get(meta.num_reqs) is meta

    def replay(self, meta: AttentionMetadata) -> torch.Tensor:
        size = meta.num_reqs
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size]  # [size, hidden]
