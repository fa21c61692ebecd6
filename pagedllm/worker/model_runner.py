"""Owns the model: builds one flat token batch + AttentionMetadata per step and runs it."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.selector import backend_for_soft_cap, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from pagedllm.kv_cache import sizing
from pagedllm.kv_cache.planning import blocks_per_sequence
from pagedllm.layers import cpu_ops
from pagedllm.layers.quantization import quantize_model
from pagedllm.models.loader import build_model, get_model_class, load_weights
from pagedllm.platform import available_ram
from pagedllm.utils import cdiv
from pagedllm.worker.block_table import PersistentBlockTable
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, replay_size
from pagedllm.worker.host_to_device import to_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecuteResult:
    """What one forward returns to the engine."""

    logits: torch.Tensor  # [num_sample_rows + prompt-logprob rows, vocab]
    prepare_time: float  # seconds spent building the step's inputs (part of the forward's time)


class ModelRunner:
    """One rank's model shard and KV pool: runs a SchedulerOutput and returns logits to sample.

    Built with its engine's tensor-parallel group; ``init_cache`` allocates the pool once the
    executor has sized it, ``release`` drops the pool and the weights at shutdown.
    """

    decode_graphs: DecodeGraphs | None = None  # captured decode steps (CUDA), set by init_cache
    cuda_graph_bytes = 0  # device memory the graphs take, measured by profile_run

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup):
        self.config = config
        self.device = config.device
        mc = config.model
        model_cls = get_model_class(mc.architecture)
        soft_cap = model_cls.attention_soft_cap(mc.hf_config)  # Gemma 2: the C kernel cannot do it
        self.backend = get_attention_backend(backend_for_soft_cap(config.attention_backend, self.device, soft_cap),
                                             self.device)
        self.model = build_model(model_cls, mc.hf_config, self.backend,
                                 mc.max_model_len, mc.dtype, self.device, tp, config.layer_ops)
        load_weights(self.model, mc.model)
        quantize_model(self.model, mc.quantization)
        if config.cache.calculate_kv_scales:
            kv_quant.start_calibration(self.model)
        if self.device.type == "cpu":
            cpu_ops.pack_model(self.model, available_ram())
            reason = self.model.enable_fused_decode(self.backend)
            if reason:
                logger.info("fused CPU decode path off: %s", reason)
        if config.compile_model:
            self._compile_layers()
        self.num_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        self.block_size = config.cache.block_size
        self.block_table = PersistentBlockTable(blocks_per_sequence(mc.max_model_len, self.block_size),
                                                config.scheduler.max_num_seqs)
        self.cache: CacheEngine | None = None

    def _compile_layers(self) -> None:
        """torch.compile every decoder layer (dynamic shapes). The C attention call is a graph
        break, and the fused C ops give way to plain torch ops inside compiled code.
        ``benchmarks/compile_probe.py`` measures it: no gain on CPU, seconds of compile time."""
        layers = self.model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, dynamic=True)

    def init_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        mc = self.config.model
        graphs = self._cuda_graphs_apply()
        # with CUDA graphs, one more block past the scheduler's: the padding rows' (cuda_graphs.py)
        self.cache = CacheEngine(mc, self.num_kv_heads, num_blocks + int(graphs), self.block_size, self.cache_dtype,
                                 self.device, num_cpu_blocks)
        with kv_quant.calibration_paused(self.model):  # capture runs dummy tokens
            self.decode_graphs = self._capture_decode_graphs(num_blocks) if graphs else None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.config.cache.cache_dtype or self.config.model.dtype

    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its share of the KV heads)."""
        return sizing.block_bytes(self.config.model, self.num_kv_heads, self.block_size, self.cache_dtype)

    def release(self) -> None:
        """Frees the KV pool, the weights and the decode graphs (their memory pool); the runner
        cannot execute afterwards."""
        self.cache = None
        self.model = None
        self.decode_graphs = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ExecuteResult:
        """Applies the cache plans, runs the batch; returns logits ``[num_sample_rows + P, vocab]``.

        A chunk with ``num_samples = n`` contributes n identical rows (a fork samples n tokens);
        after all sampling rows come the ``P`` prompt-logprob rows, chunk by chunk.
        """
        self.block_table.release(out.released_ids)
        # order matters: a block swapped out this step may be the target of a swap-in or copy
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        if not out.chunks:
            return ExecuteResult(torch.empty(0, self.model.config.vocab_size), 0.0)
        t0 = time.perf_counter()
        input_ids, positions, meta, logit_idx = self.prepare_inputs(out)
        prepare_time = time.perf_counter() - t0
        if self.decode_graphs is not None and self.decode_graphs.holds(meta):
            hidden = self.decode_graphs.replay(meta)  # [padded num_tokens, hidden]
        else:
            hidden = self.model(input_ids, positions, self.cache.layer_caches, meta)  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[logit_idx])  # [num_sample_rows + prompt rows, vocab]
        return ExecuteResult(logits, prepare_time)

    def prepare_inputs(self, out: SchedulerOutput):
        chunks = out.chunks
        query_lens = np.fromiter((c.num_new_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        seq_lens = np.fromiter((c.seq_len for c in chunks), dtype=np.int64, count=len(chunks))
        rows = np.fromiter((self.block_table.apply(c) for c in chunks), dtype=np.int64, count=len(chunks))
        tables = self.block_table.gather(rows, max(c.num_blocks for c in chunks))
        ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=int(query_lens.sum()))
        last = np.cumsum(query_lens) - 1
        samples = np.fromiter((c.num_samples for c in chunks), dtype=np.int64, count=len(chunks))
        sample_idx = np.repeat(last, samples)  # each sampling chunk's last token, n times on a fork
        prompt_rows = np.fromiter((c.num_prompt_logprob_rows for c in chunks), dtype=np.int64, count=len(chunks))
        if prompt_rows.any():  # prompt_logprobs: the chunk's first k positions, after the samples
            starts = np.repeat(last + 1 - query_lens, prompt_rows)
            offsets = np.arange(int(prompt_rows.sum())) - np.repeat(np.cumsum(prompt_rows) - prompt_rows, prompt_rows)
            sample_idx = np.concatenate([sample_idx, starts + offsets])
        host = AttentionMetadata.host_arrays(query_lens, seq_lens, tables, self.block_size)
        host.update(input_ids=ids, sample_idx=sample_idx)  # positions are already there
        size = replay_size(self.decode_graphs.sizes, host) if self.decode_graphs is not None else None
        if size is not None:  # a decode-only step: into the CUDA graphs' input buffers
            return self.decode_graphs.prepare(host, size)
        dev = to_device(host, self.device)  # one host->device copy for the whole step
        meta = AttentionMetadata.from_tensors(dev, host, self.block_size)
        return dev["input_ids"], dev["positions"], meta, dev["sample_idx"]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int) -> None:
        """One forward at the step's token budget, with a throwaway cache, to find peak memory."""
        seq = min(num_tokens, max_model_len)
        num_seqs = cdiv(num_tokens, seq)
        blocks_per_seq = blocks_per_sequence(seq, self.block_size)
        saved = self.cache
        self.init_cache(num_seqs * blocks_per_seq)
        chunks = [ScheduledChunk(f"profile-{i}", [0] * min(seq, num_tokens - i * seq), 0, 0,
                                 list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 1)
                  for i in range(num_seqs)]
        with kv_quant.calibration_paused(self.model):  # dummy tokens: no fp8 KV scales from them
            self.execute(SchedulerOutput(chunks=chunks))
        if self.decode_graphs is not None:  # captured over the throwaway cache: measured, then dropped
            self.cuda_graph_bytes, self.decode_graphs = self.decode_graphs.memory_bytes, None
            torch.cuda.empty_cache()
        self.cache = saved
        self.block_table.reset()

    # ------------------------------------------------------------------ CUDA graphs (worker/cuda_graphs.py)
    def cuda_graph_memory(self) -> int:
        """Device memory the decode graphs take (measured by ``profile_run``), for the KV budget."""
        return self.cuda_graph_bytes

    def _cuda_graphs_apply(self) -> bool:
        c = self.config
        if not c.cuda_graphs:  # not CUDA, or enforce_eager
            return False
        reason = self.backend.cuda_graph_blocker(c.model.dtype, self.cache_dtype, c.model.head_dim, self.block_size)
        if reason is None and (c.parallel.tensor_parallel_size > 1 or c.compile_model):
            reason = "tensor parallelism and compile_model run eagerly"
        if reason:
            logger.info("CUDA graphs off: %s", reason)
        return reason is None

    def _capture_decode_graphs(self, pad_block: int) -> DecodeGraphs:
        mc = self.config.model
        max_blocks_per_seq = blocks_per_sequence(mc.max_model_len, self.block_size)
        graphs = DecodeGraphs(capture_sizes(self.config.scheduler.max_num_seqs), max_blocks_per_seq, self.block_size,
                              mc.max_model_len, pad_block, self.device)
        graphs.capture(self.model, self.cache.layer_caches)
        return graphs
