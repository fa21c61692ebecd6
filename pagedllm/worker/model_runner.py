"""Owns the model: builds one flat token batch + AttentionMetadata per step and runs it."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import cloudpickle
import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention import kv_quant
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.selector import backend_for_soft_cap, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.contracts.host_to_device import to_device
from pagedllm.contracts.scheduler_output import ScheduledChunk, SchedulerOutput
from pagedllm.contracts.tier_ops import LoadReport, TierOps
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineGroup, PipelineStage, stage_of
from pagedllm.kv_cache import sizing
from pagedllm.kv_cache.offload.worker_store import TierStore, build_tier_store
from pagedllm.kv_cache.planning import blocks_per_sequence
from pagedllm.kv_cache.spec import kv_spec_for
from pagedllm.layers import cpu_ops, kernel_tuning
from pagedllm.layers.quantization import quantize_model
from pagedllm.lora.model import LoRAModel
from pagedllm.models.loader import build_model, get_model_class, load_named_weights, load_weights
from pagedllm.multimodal.mrope import batch_positions
from pagedllm.platform import available_ram, huge_pages_enabled, keep_freed_memory, module_to_huge_pages
from pagedllm.utils import cdiv, graph_break
from pagedllm.worker import sleep_mode
from pagedllm.worker.block_table import PersistentBlockTable
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.cuda_graphs import DecodeGraphs, agree_on_schedule, capture_sizes, replay_size
from pagedllm.worker.pipeline_execute import StagePipeline
from pagedllm.worker.threads import adaptive_threads, follow_free_cores

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecuteResult:
    """What one forward returns to the engine."""

    logits: torch.Tensor  # [num_sample_rows + prompt-logprob rows + verify rows, vocab]
    prepare_time: float  # seconds spent building the step's inputs (part of the forward's time)
    tier_report: LoadReport | None = None  # KV tier loads settled this step (kv_cache/offload/)
    hidden: torch.Tensor | None = None  # SchedulerOutput.return_hidden: the rows logits came from [rows, hidden]
    span_sums: torch.Tensor | None = None  # SchedulerOutput.pool_spans: each span's rows summed [spans, hidden]
    # SchedulerOutput.pool_rows: their rows one after another [rows, hidden], through a classifier's head
    # [rows, num_labels]
    span_rows: torch.Tensor | None = None
    encoder_time: float = 0.0  # seconds the vision tower ran this step (multimodal: images encoded)


class ModelRunner:
    """One rank's model shard and KV pool: runs a SchedulerOutput and returns logits to sample.

    Built with its engine's tensor-parallel group and, under pipeline parallelism, its link to
    the other stages (``pp``: then it holds only its stage's layers and their KV);
    ``init_cache`` allocates the pool once the executor has sized it, ``release`` drops the pool
    and the weights at shutdown.
    """

    decode_graphs: DecodeGraphs | None = None  # captured decode steps (CUDA), set by init_cache
    cuda_graph_bytes = 0  # device memory the graphs take, measured by profile_run
    tiers: TierStore | None = None  # this rank's KV tiers (CPU, disk), set by init_cache

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup, pp: PipelineGroup | None = None):
        self.config = config
        self.tp = tp
        self.device = config.device
        mc = config.model
        self.stage = stage_of(mc.num_layers, pp.layout.pp_size, pp.layout.stage) if pp else \
            PipelineStage.whole(mc.num_layers)
        self.pipeline = StagePipeline(pp, mc.hidden_size, mc.vocab_size, mc.dtype, self.device) if pp else None
        model_cls = get_model_class(mc.architecture)
        soft_cap = model_cls.attention_soft_cap(mc.hf_config)  # Gemma 2: the C kernel cannot do it
        kv_kind = kv_spec_for(mc.hf_config, mc.num_kv_heads, mc.head_dim).kind  # MLA: the latent backend
        self.backend = get_attention_backend(backend_for_soft_cap(config.attention_backend, self.device, soft_cap),
                                             self.device, kv_kind)
        self.model = build_model(model_cls, mc.hf_config, self.backend,
                                 mc.max_model_len, mc.dtype, self.device, tp, config.layer_ops, self.stage)
        if mc.language_model_only and getattr(self.model, "is_multimodal", False):
            self.model.drop_vision()  # before loading: the tower's tensors are never read into memory
        load_weights(self.model, mc.model, mc.load_format, mc.seed)
        quantize_model(self.model, mc.quantization)
        if config.cache.calculate_kv_scales:
            kv_quant.start_calibration(self.model)
        # enable_lora: adapter slots on the decoder layers' projections (lora/model.py); before the
        # one-call C decoder, which reads them
        self.lora = (LoRAModel(self.model, getattr(self.model, "packed_modules", {}), config.lora, mc.dtype,
                               self.device) if config.lora is not None else None)
        if self.device.type == "cpu":
            if huge_pages_enabled():
                moved = module_to_huge_pages(self.model)
                logger.info("weights in 2 MiB pages: %.1f MiB", moved / 2**20)
            elif envs.PAGEDLLM_HUGE_PAGES:
                logger.info("weights stay in 4 KiB pages: no transparent huge pages here (not Linux, or "
                            "/sys/kernel/mm/transparent_hugepage/enabled is [never])")
            if keep_freed_memory():
                logger.debug("glibc malloc keeps freed memory in its heaps (PAGEDLLM_HEAP_MALLOC)")
            reason = self._prepare_cpu_kernels()
            if reason:
                logger.info("fused CPU decode path off: %s", reason)
        if config.compile_model:
            self._compile_layers()
        self.num_kv_heads = self.model.stage_layers()[0].self_attn.num_kv_heads
        self.kv_spec = sizing.model_kv_spec(mc, self.num_kv_heads)  # what a token stores per layer
        self.kv_spec.check_cache(self.cache_dtype, config.cache.calculate_kv_scales)
        self.block_size = config.cache.block_size
        self.block_table = PersistentBlockTable(blocks_per_sequence(mc.max_model_len, self.block_size),
                                                config.scheduler.max_num_seqs)
        self.cache: CacheEngine | None = None
        # multimodal: image content hash -> its embeddings [placeholder tokens, hidden]
        # (which entries live is decided by the engine: multimodal/encoder_cache.py)
        self.encoder_cache: dict[bytes, torch.Tensor] = {}
        self._cache_blocks = (0, 0)  # (device, CPU swap) blocks of the pool, reallocated by wake_up
        self._graphs_wanted = False  # the pool has the decode graphs' padding block (init_cache)
        self.weights_asleep = False
        self.sleeping_weights: sleep_mode.SleepingWeights | None = None
        self._profiler: torch.profiler.profile | None = None
        self.cpu_threads = adaptive_threads(config)  # None unless the thread count follows the free cores

    def _prepare_cpu_kernels(self) -> str | None:
        """The CPU kernels' own copies of the weights (packed GEMM layouts) and the one-call
        decoder's pointers into them: made at load and again whenever the weights change.
        Returns why the one-call decoder is off, or None."""
        cpu_ops.pack_model(self.model, available_ram())
        # before the decoder: it reads the tile/panel switch and the attention backend's parallel_work
        kernel_tuning.tune_model(self.model, backend=self.backend)
        return self._enable_fused_decode()

    def _enable_fused_decode(self) -> str | None:
        if self.pipeline is not None:
            return "pipeline parallelism: the C decoder runs the whole layer stack in one call"
        return self.model.enable_fused_decode(self.backend)

    def _compile_layers(self) -> None:
        """torch.compile every decoder layer (dynamic shapes). The C attention call is a graph
        break, and the fused C ops give way to plain torch ops inside compiled code.
        ``benchmarks/compile_probe.py`` measures it: no gain on CPU, seconds of compile time."""
        graph_break.apply_graph_breaks()
        layers = self.model.model.layers
        for i in range(self.stage.start, self.stage.end):
            layers[i] = torch.compile(layers[i], dynamic=True)

    def init_cache(self, num_blocks: int, num_cpu_blocks: int = 0, with_tiers: bool = True,
                   tier_fingerprints: tuple[str, ...] = ()) -> None:
        """Allocates the KV pool (and the KV tiers with ``with_tiers``; ``tier_fingerprints``: every
        rank's disk-tier fingerprint, computed once by the executor, else computed here)."""
        self._cache_blocks = (num_blocks, num_cpu_blocks)
        self._allocate_cache()
        if with_tiers:
            fingerprint = tier_fingerprints[self.tp.rank] if tier_fingerprints else None
            self.tiers = build_tier_store(self.config, self.cache.kv, self.tp, self.block_bytes(), fingerprint)

    def _allocate_cache(self) -> None:
        """The KV pool of ``_cache_blocks``, and the decode graphs over it once the weights are there."""
        num_blocks, num_cpu_blocks = self._cache_blocks
        self._graphs_wanted = self._cuda_graphs_apply()
        # with CUDA graphs, one more block past the scheduler's: the padding rows' (cuda_graphs.py)
        self.cache = CacheEngine(self.kv_spec, self.stage.num_layers, num_blocks + int(self._graphs_wanted),
                                 self.block_size, self.cache_dtype, self.device, num_cpu_blocks)
        if not self.weights_asleep:
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        graphs = self._decode_graphs(self._cache_blocks[0]) if self._graphs_wanted else None
        if self.device.type == "cuda" and self.tp.size > 1:  # every CUDA rank, capturing or not
            agree_on_schedule(self.tp, graphs.schedule() if graphs else [], self.device)
        if graphs is not None:
            with kv_quant.calibration_paused(self.model):  # capture runs dummy tokens
                graphs.capture(self.model, self.cache.layer_caches)
        self.decode_graphs = graphs

    def persist_kv_tiers(self, ops: TierOps) -> None:
        """Writes the blocks of ``ops.moves`` to this rank's disk tier; returns once every rank's are there."""
        if self.tiers is not None:
            self.tiers.apply(ops)
        self.sync_kv_tiers(False)

    def sync_kv_tiers(self, clear_disk: bool) -> None:
        """Waits for this rank's queued disk writes, then (with ``clear_disk``) deletes its disk
        entries; returns once every rank has (a barrier)."""
        if self.tiers is not None:
            self.tiers.flush()
            if clear_disk:
                self.tiers.clear_disk()
        self.tp.barrier()

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.config.cache.cache_dtype or self.config.model.dtype

    def block_bytes(self) -> int:
        """Bytes of one KV block on the rank that holds the most (its share of the KV heads, of
        its stage's layers): every rank holds the same block ids."""
        mc, pp_size = self.config.model, self.config.parallel.pipeline_parallel_size
        layers = max(stage_of(mc.num_layers, pp_size, s).num_layers for s in range(pp_size))
        return sizing.block_bytes(mc, self.num_kv_heads, self.block_size, self.cache_dtype, layers)

    def release(self) -> None:
        """Frees the KV pool, the weights and the decode graphs (their memory pool); the runner
        cannot execute afterwards."""
        if self.cache is not None:
            self.cache.close()
        self.cache = None
        self.model = None
        self.decode_graphs = None
        if self.tiers is not None:
            self.tiers.close()  # after its queued disk writes
            self.tiers = None

    # ------------------------------------------------------------------ sleep mode (worker/sleep_mode.py)
    def sleep(self, level: int) -> None:
        """Frees the KV pool (its tensors, the decode graphs, the one-call decoder's hold on them);
        level 1 offloads the weights to host memory (on the CPU they stay where they are), level 2
        discards them. Sleeping again at level 2 discards weights a level 1 kept."""
        self._drop_cache()
        self.sleeping_weights = sleep_mode.put_to_sleep(self.model, level, self.device, self.sleeping_weights)
        self.weights_asleep = True
        if level == 2 and self.device.type == "cpu":
            cpu_ops.drop_packed(self.model)  # the packed copies of the discarded weights
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back to the driver, for other processes

    def _drop_cache(self) -> None:
        if self.cache is None:
            return
        self.cache.close()
        self.cache, self.decode_graphs = None, None
        self.block_table.reset()
        if self.device.type == "cpu":
            self.model.disable_fused_decode()  # it holds pointers into the pool

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Undoes ``sleep`` for ``tags`` ("weights": their storage back, with their values after a
        level-1 sleep, uninitialized after level 2; "kv_cache": a new, empty pool of the same size)."""
        if "weights" in tags and self.weights_asleep:
            discarded = self.sleeping_weights is not None and self.sleeping_weights.discarded
            sleep_mode.wake(self.model, self.sleeping_weights)
            self.sleeping_weights, self.weights_asleep = None, False
            if discarded and self.device.type == "cpu" and huge_pages_enabled():
                module_to_huge_pages(self.model)  # where the load put them: decode streams them faster
            if self.cache is not None:
                self._capture_graphs()
        if "kv_cache" in tags and self.cache is None:
            self._allocate_cache()
        if self.device.type == "cpu" and self.cache is not None and not self.weights_asleep:
            self._enable_fused_decode()

    def is_sleeping(self) -> bool:
        return self.weights_asleep or self.cache is None

    # ------------------------------------------------------------------ weight updates (collective_rpc)
    @property
    def model_runner(self) -> ModelRunner:
        """vLLM's ``worker.model_runner``: here the runner is the worker, so a ``collective_rpc``
        callable written as ``lambda worker: worker.model_runner.model`` finds the model."""
        return self

    def load_weights(self, weights) -> list[str]:
        """Copies ``(name, tensor)`` pairs (full, unsharded tensors with the checkpoint's names, any
        subset of them) into the weights through the model's weight loaders, so each
        tensor-parallel rank keeps its shard; returns the parameter names written. Cached prefixes
        were computed with the old weights: ``LLM.collective_rpc`` forgets them for this method."""
        self._check_updatable()
        loaded = load_named_weights(self.model, weights)
        self._weights_changed()
        return sorted(loaded)

    def update_weights(self, named_tensors) -> list[str]:
        """``load_weights`` from a state dict (``{name: tensor}``) or ``(name, tensor)`` pairs."""
        return self.load_weights(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)

    def reload_weights(self) -> None:
        """Loads the weights again from the engine's checkpoint (after a level-2 sleep, or to undo updates)."""
        self._check_updatable()
        mc = self.config.model
        load_weights(self.model, mc.model, mc.load_format, mc.seed)
        self._weights_changed()

    def _check_updatable(self) -> None:
        if self.config.model.quantization is not None:
            raise ValueError(f"weight updates need an unquantized model; this one runs "
                             f"quantization={self.config.model.quantization!r}")
        if self.weights_asleep:
            raise RuntimeError("the weights are asleep: call wake_up(tags=['weights']) before loading weights")

    def _weights_changed(self) -> None:
        if self.device.type == "cpu":
            self._prepare_cpu_kernels()  # their packed copies hold the old values

    # ------------------------------------------------------------------ collective_rpc and profiling
    def rpc(self, payload: bytes):
        """One rank's ``collective_rpc`` call: ``payload`` is the cloudpickled ``(method, args,
        kwargs)``; a method name is looked up on the runner, a callable gets the runner first."""
        method, args, kwargs = cloudpickle.loads(payload)
        fn = getattr(self, method) if isinstance(method, str) else functools.partial(method, self)
        return fn(*args, **kwargs)

    def start_profile(self, directory: str) -> None:
        """Starts a torch profiler; ``stop_profile`` writes its trace to ``directory``
        (``<host>_pagedllm-tp<rank>-pp<stage>.<time>.pt.trace.json``, Chrome trace format)."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        stage = self.pipeline.pp.layout.stage if self.pipeline is not None else 0
        name = f"pagedllm-tp{self.tp.rank}-pp{stage}"
        self._profiler = torch.profiler.profile(
            activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, name))
        self._profiler.start()

    def stop_profile(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # writes the trace (on_trace_ready)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ExecuteResult:
        """Applies the cache plans, runs the batch; returns logits ``[num_sample_rows + P + V, vocab]``.

        A chunk with ``num_samples = n`` contributes n identical rows (a fork samples n tokens);
        after all sampling rows come the ``P`` prompt-logprob rows, chunk by chunk, then the ``V``
        rows that verify speculative drafts (``num_spec_tokens + 1`` per speculative chunk).
        """
        follow_free_cores(self.cpu_threads)
        self.block_table.release(out.released_ids)
        if out.tier_ops:  # first: blocks evicted to the tiers may be written by what follows
            self.tiers.apply(out.tier_ops)
        # order matters: a block swapped out this step may be the target of a swap-in or copy
        self.cache.swap_out(out.blocks_to_swap_out)
        self.cache.swap_in(out.blocks_to_swap_in)
        self.cache.copy_blocks(out.blocks_to_copy)
        for slot, lora_request in out.lora_loads:  # adapters admitted this step, before they run
            self.lora.load(slot, lora_request)
        if not out.chunks:
            return ExecuteResult(torch.empty(0, self.config.model.vocab_size), 0.0, self._tier_report(out))
        if self.pipeline is not None:  # KV tiers are refused under pipeline parallelism (arg_utils)
            return ExecuteResult(*self.pipeline.run(self, out))
        t0 = time.perf_counter()
        self._run_encoder(out)
        encoder_time, t0 = time.perf_counter() - t0, time.perf_counter()
        host = self._host_inputs(out)
        fused = self._fused_from_host(out, host)
        if fused is not None:  # the one-call C decoder straight from the host arrays: no tensors, no metadata
            prepare_time = time.perf_counter() - t0
            hidden = fused.forward_host(host)  # [num_tokens, hidden]
        else:
            input_ids, positions, meta, logit_idx = self._model_inputs(host)
            prepare_time = time.perf_counter() - t0
            hidden = self._forward(out, input_ids, positions, meta)
        # [sample + prompt + verify rows, hidden]; a decode-only step samples every row once, in order
        if _every_row_once(host, hidden.shape[0]):
            rows = hidden
        else:
            rows = hidden[torch.from_numpy(host["sample_idx"]) if fused else logit_idx]
        logits = self.model.compute_logits(rows)  # [sample + prompt + verify rows, vocab]
        spans = (torch.stack([hidden[a:a + n].float().sum(0) for a, n in out.pool_spans])  # [spans, hidden]
                 if out.pool_spans else None)
        return ExecuteResult(logits, prepare_time, self._tier_report(out), rows if out.return_hidden else None,
                             spans, self._span_rows(hidden, out.pool_rows), encoder_time)

    def _forward(self, out: SchedulerOutput, input_ids, positions, meta) -> torch.Tensor:
        embeds = self._inputs_embeds(out.chunks, input_ids)  # None unless a chunk covers image placeholders
        if embeds is not None:
            return self.model(input_ids, positions, self.cache.layer_caches, meta, inputs_embeds=embeds)
        if self.decode_graphs is not None and self.decode_graphs.holds(meta):
            return self.decode_graphs.replay(meta)  # [padded num_tokens, hidden]
        return self.model(input_ids, positions, self.cache.layer_caches, meta)  # [num_tokens, hidden]

    def _fused_from_host(self, out: SchedulerOutput, host: dict[str, np.ndarray]):
        """The one-call C decoder when it runs this step the way ``DecoderModel.forward`` would pick
        it (plain positions, no image rows or spans, its token limit; adapter tokens where the C
        side takes them: ``applies``), else None."""
        fused = getattr(getattr(self.model, "model", None), "fused_decoder", None)
        if fused is None:
            return None
        if host["positions"].ndim != 1 or "attend_ends" in host or any(c.mm_spans for c in out.chunks):
            return None
        return fused if fused.applies(len(host["input_ids"]), self.cache.layer_caches) else None

    # ------------------------------------------------------------------ multimodal (multimodal/encoder_cache.py)
    def _run_encoder(self, out: SchedulerOutput) -> None:
        """Drops the encoder-cache entries the scheduler freed, then encodes this step's new images
        (the vision tower + projector run once per image; every chunk over its run reads the rows)."""
        for image in out.encoder_frees:
            self.encoder_cache.pop(image, None)
        for item in out.encoder_inputs:
            data = {key: value.to(self.device) for key, value in item.data.items()}
            self.encoder_cache[item.hash] = self.model.encode_image(data)  # [placeholder tokens, hidden]

    def _profile_encoder(self) -> None:
        """A vision-language model's share of the peak: its largest image through the vision tower
        while a full encoder cache (a step's budget of embedding rows) is held."""
        dummy = getattr(self.model, "dummy_image", None)
        if dummy is None or getattr(self.model, "language_model_only", False) or self.config.model.skip_mm_profiling:
            return
        mc = self.config.model
        held = torch.empty(self.config.scheduler.max_num_batched_tokens, mc.hidden_size, dtype=mc.dtype,
                           device=self.device)  # [encoder cache rows, hidden]
        image = dummy(self.config.scheduler.max_num_batched_tokens)  # an image may take one step's encoder budget
        self.model.encode_image({key: value.to(self.device) for key, value in image.items()})
        del held

    def _inputs_embeds(self, chunks: list[ScheduledChunk], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's token embeddings with each covered image placeholder replaced by its row of the
        image's embeddings (a chunk may start or end inside a run), or None when no chunk covers one."""
        if not any(c.mm_spans for c in chunks):
            return None
        embeds = self.model.embed_input_ids(input_ids)  # [num_tokens, hidden]
        base = 0  # the chunk's first row in the flat batch
        for chunk in chunks:
            for image, offset, length in chunk.mm_spans:
                lo, hi = max(offset, chunk.start), min(offset + length, chunk.seq_len)  # prompt positions covered
                rows = self.encoder_cache[image][lo - offset:hi - offset]  # [hi - lo, hidden]
                embeds[base + lo - chunk.start:base + hi - chunk.start] = rows.to(embeds.dtype)
            base += chunk.num_new_tokens
        return embeds

    def _span_rows(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor | None:
        """Per-token pooling: the spans' rows, as a classifier's head sees them (its logits) or
        as an embedding model's final-normed hidden states."""
        if not spans:
            return None
        rows = torch.cat([hidden[a:a + n] for a, n in spans])  # [sum of span rows, hidden]
        if self.config.model.is_classifier:
            rows = self.model.compute_logits(rows)  # [sum of span rows, num_labels]
        return rows.float()

    def _tier_report(self, out: SchedulerOutput) -> LoadReport | None:
        """The step's tier loads, settled after its forward (the disk reads overlapped it), and the
        tiers' failures since the last report (so any step with tier work reports)."""
        return self.tiers.collect() if out.tier_ops else None

    def forward_stage(self, input_ids, positions, meta, intermediate=None):
        """This rank's stage of the model over one batch (pipeline parallelism: see pipeline_execute)."""
        return self.model(input_ids, positions, self.cache.layer_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)  # [rows, vocab]

    def shard_summary(self) -> list[dict]:
        """Every rank's stage: its layers, the layers its KV pool covers, its parameter count
        (gathered over the pipeline's world group; this rank alone without one)."""
        kv_layers = self.cache.kv.shape[0] if self.cache is not None else 0
        params = sum(p.numel() for p in self.model.parameters())
        # on this rank's device: NCCL refuses CPU tensors
        mine = torch.tensor([self.stage.start, self.stage.end, kv_layers, params], dtype=torch.int64,
                            device=self.device)
        rows = self.pipeline.pp.all_gather(mine) if self.pipeline is not None else mine[None]
        keys = ("first_layer", "end_layer", "kv_layers", "num_params")
        return [dict(zip(keys, row)) for row in rows.tolist()]

    def pipeline_max_in_flight(self) -> int:
        """The most micro-batches one step has had in flight (0 without pipeline parallelism)."""
        return self.pipeline.max_in_flight if self.pipeline is not None else 0

    def prepare_inputs(self, out: SchedulerOutput):
        """``(input_ids, positions, AttentionMetadata, sample_idx)`` of the step, on the device."""
        return self._model_inputs(self._host_inputs(out))

    def _host_inputs(self, out: SchedulerOutput) -> dict[str, np.ndarray]:
        """The step's inputs as host arrays (``AttentionMetadata.host_arrays`` plus ``input_ids``,
        ``sample_idx`` and, for image runs, ``attend_ends``); applies the chunks' block-table
        updates and the LoRA batch mapping."""
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
        verify_rows = np.fromiter((c.num_verify_rows for c in chunks), dtype=np.int64, count=len(chunks))
        if verify_rows.any():  # speculative drafts: the chunk's last k + 1 positions, after everything else
            starts = np.repeat(last + 1 - verify_rows, verify_rows)
            offsets = np.arange(int(verify_rows.sum())) - np.repeat(np.cumsum(verify_rows) - verify_rows, verify_rows)
            sample_idx = np.concatenate([sample_idx, starts + offsets])
        if self.lora is not None:  # each token runs with its chunk's adapter slot
            slots = np.fromiter((c.lora_slot for c in chunks), dtype=np.int64, count=len(chunks))
            self.lora.set_batch(np.repeat(slots, query_lens))  # read by the slots and the one-call C decoder
        host = AttentionMetadata.host_arrays(query_lens, seq_lens, tables, self.block_size)
        host.update(input_ids=ids, sample_idx=sample_idx)  # positions are already there
        self._offset_long_rope(chunks, query_lens, host)
        host["positions"] = batch_positions([c.mrope_positions for c in chunks], query_lens, host["positions"])
        if any(c.attend_ends is not None for c in chunks):  # bidirectional image runs (attention/metadata.py)
            host["attend_ends"] = np.concatenate([c.attend_ends if c.attend_ends is not None else
                                                  np.arange(c.start + 1, c.seq_len + 1, dtype=np.int32)
                                                  for c in chunks])
        return host

    def _model_inputs(self, host: dict[str, np.ndarray]):
        # [3, num_tokens]: M-RoPE image rows; attend_ends: image runs; never a graph replay
        plain = host["positions"].ndim == 1 and "attend_ends" not in host
        size = replay_size(self.decode_graphs.sizes, host) if self.decode_graphs is not None and plain else None
        if size is not None:  # a decode-only step: into the CUDA graphs' input buffers
            return self.decode_graphs.prepare(host, size)
        dev = to_device(host, self.device)  # one host->device copy for the whole step
        meta = AttentionMetadata.from_tensors(dev, host, self.block_size)
        return dev["input_ids"], dev["positions"], meta, dev["sample_idx"]

    def _offset_long_rope(self, chunks: list[ScheduledChunk], query_lens: np.ndarray, host: dict) -> None:
        """LongRoPE: the positions of long-factor requests index the long half of the model's rotary
        table (layers/rotary_variants.py); the attention metadata keeps the true positions."""
        long = np.fromiter((c.long_rope for c in chunks), dtype=bool, count=len(chunks))
        if not long.any():
            return
        offset = getattr(self.model, "long_rope_offset", None)
        if offset is None:
            raise RuntimeError(f"{type(self.model).__name__} has no LongRoPE table, but a request asked for the "
                               "long factors")
        host["positions"] = host["positions"] + np.repeat(long * offset, query_lens)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int) -> None:
        """One forward at the step's token budget, with a throwaway cache, to find peak memory."""
        seq = min(num_tokens, max_model_len)
        num_seqs = cdiv(num_tokens, seq)
        blocks_per_seq = blocks_per_sequence(seq, self.block_size)
        saved = self.cache
        self.init_cache(num_seqs * blocks_per_seq, with_tiers=False)
        chunks = [ScheduledChunk(f"profile-{i}", [0] * min(seq, num_tokens - i * seq), 0, 0,
                                 list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 1,
                                 lora_slot=0 if self.lora is not None else -1)  # every token through LoRA
                  for i in range(num_seqs)]
        with kv_quant.calibration_paused(self.model):  # dummy tokens: no fp8 KV scales from them
            self.execute(SchedulerOutput(chunks=chunks))
        self._profile_encoder()
        if self.decode_graphs is not None:  # captured over the throwaway cache: measured, then dropped
            self.cuda_graph_bytes, self.decode_graphs = self.decode_graphs.memory_bytes, None
            torch.cuda.empty_cache()
        self.cache = saved
        self.block_table.reset()

    # ------------------------------------------------------------------ CUDA graphs (worker/cuda_graphs.py)
    def cuda_graph_memory(self) -> int:
        """Device memory the decode graphs take (measured by ``profile_run``), for the KV budget:
        the most any tensor-parallel rank's took, since every rank gets the same block count."""
        if self.tp.size == 1:
            return self.cuda_graph_bytes
        return max(row[0] for row in self.tp.gather_ints([self.cuda_graph_bytes], self.device))

    def _cuda_graphs_apply(self) -> bool:
        c = self.config
        if not c.cuda_graphs:  # not CUDA, or enforce_eager
            return False
        reason = self.backend.cuda_graph_blocker(c.model.dtype, self.cache_dtype, c.model.head_dim, self.block_size)
        if reason is None:  # layers that cannot be captured say why (e.g. FusedMoE.cuda_graph_blocker)
            reason = next(filter(None, (m.cuda_graph_blocker() for m in self.model.modules()
                                        if hasattr(m, "cuda_graph_blocker"))), None)
        if reason is None and (c.parallel.pipeline_parallel_size > 1 or c.compile_model):
            reason = "pipeline parallelism and compile_model run eagerly"
        if reason is None and c.parallel.tensor_parallel_size > 1 and not envs.PAGEDLLM_TP_CUDA_GRAPHS:
            reason = "tensor parallelism captures only with PAGEDLLM_TP_CUDA_GRAPHS=1 (not yet run on GPUs)"
        if reason:
            logger.info("CUDA graphs off: %s", reason)
        return reason is None

    def _decode_graphs(self, pad_block: int) -> DecodeGraphs:
        mc = self.config.model
        max_blocks_per_seq = blocks_per_sequence(mc.max_model_len, self.block_size)
        return DecodeGraphs(capture_sizes(self.config.scheduler.max_num_seqs), max_blocks_per_seq, self.block_size,
                            mc.max_model_len, pad_block, self.device,
                            self.lora.batch if self.lora is not None else None)  # LoRA: its mapping captured too


def _every_row_once(host: dict[str, np.ndarray], hidden_rows: int) -> bool:
    """Whether ``sample_idx`` is ``0 .. hidden_rows - 1``: the logits' rows are the hidden rows as
    they are (a decode-only step without prompt logprobs, forks or drafts, and no CUDA-graph
    padding rows), no gather needed."""
    idx = host["sample_idx"]
    return len(idx) == hidden_rows == len(host["input_ids"]) and idx.tolist() == list(range(hidden_rows))
