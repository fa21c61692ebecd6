"""Typed, frozen engine configuration. Validation raises ValueError naming the parameter."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm import envs
from pagedllm.contracts.speculative_config import SpeculativeConfig
from pagedllm.utils import parse_size

ALLOWED_BLOCK_SIZES = (8, 16, 32, 64, 128)
PREEMPTION_MODES = ("recompute", "swap")
PREALLOCATION_MODES = ("none", "max_model_len", "request")
# "generate": text generation; "pooling": one vector per prompt (LLM.embed, /v1/embeddings)
RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# "fcfs": arrival order; "priority": by (request priority, arrival), lowest value first (vLLM's)
SCHEDULING_POLICIES = ("fcfs", "priority")
# "auto": the fast (Rust) tokenizer when there is one; "slow": the Python one (vLLM's use_fast=False)
TOKENIZER_MODES = ("auto", "slow")
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
DTYPES = ("auto", *_DTYPES)  # what resolve_dtype accepts


@dataclass(frozen=True)
class ModelConfig:
    model: str  # resolved local directory
    tokenizer: str
    hf_config: Any = field(compare=False, repr=False)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seed: int = 0
    quantization: str | None = None  # weight-only, layers/quantization/ (int8, int4 or the checkpoint's format)
    tokenizer_mode: str = "auto"  # one of TOKENIZER_MODES
    trust_remote_code: bool = False  # passed to transformers for the config and the tokenizer
    served_model_names: tuple[str, ...] = ()  # what HTTP clients call the model (the first one in metrics)
    max_logprobs: int = 20  # most logprobs a request may ask for (-1: the whole vocabulary)
    # sampling defaults from the model's generation_config.json ((SamplingParams field, value) pairs),
    # for requests that leave those fields unset; empty with generation_config="vllm"
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    enable_sleep_mode: bool = False  # LLM.sleep()/wake_up() allowed (engine/llm_engine.py)
    load_format: str = "auto"  # vLLM's: "auto" / "safetensors" read the checkpoint, "dummy" random weights
    # vision-language models (multimodal/processor.py): vLLM's limit_mm_per_prompt as (modality, most items)
    # pairs (no pair: no limit), and mm_processor_kwargs, the HF processor options every request starts from
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = ()
    mm_processor_kwargs: tuple[tuple[str, Any], ...] = ()
    # GiB of recent images' / videos' processor outputs kept by content (multimodal/processor_cache.py; 0: none)
    mm_processor_cache_gb: float = 4.0
    # vLLM's language_model_only: a vision-language checkpoint's language model alone (no tower or
    # projector loaded; multimodal inputs refused); nothing changes for a text-only model
    language_model_only: bool = False
    # vLLM's skip_mm_profiling: the start-up memory profile runs no image through the vision tower, so
    # the KV pool leaves no room for the tower's activations (the user's estimate to make)
    skip_mm_profiling: bool = False
    # where chat image URLs may come from besides data: URLs (entrypoints/openai/media.py)
    allowed_local_media_path: str | None = None  # a directory (real path) for file:// URLs
    allowed_media_domains: tuple[str, ...] = ()  # hosts for http(s) URLs

    @property
    def is_classifier(self) -> bool:
        """A ``*ForSequenceClassification`` checkpoint: its head gives ``num_labels`` class logits."""
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def num_labels(self) -> int:
        return int(getattr(self.hf_config, "num_labels", 0) or 0) if self.is_classifier else 0

    def __post_init__(self):
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} must be one of {TOKENIZER_MODES}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an integer >= 0, or -1 (no limit)")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; overrides gpu_memory_utilization
    swap_space: int = 4 * 1024**3  # bytes of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    watermark: float = 0.01
    cache_dtype: torch.dtype | None = None  # KV storage dtype; None: the model's dtype
    # KV tiers (kv_cache/offload/): evicted prefix blocks kept in CPU memory (bytes per rank) and
    # on disk (a directory shared by every engine using it, within a byte budget for all of it)
    kv_offload_cpu_bytes: int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int = 0
    # a remote tier below those: a Redis/Valkey server shared by replicas (offload/remote_tier.py)
    kv_offload_remote: str | None = None  # redis://[user:password@]host:port/db (rediss:// TLS, valkey://)
    kv_offload_remote_ttl_s: int | None = None  # seconds each value lives; None: until Redis evicts it
    # prefill/decode disaggregation over the remote tier (offload/kv_transfer.py): None (write-through,
    # reads), "producer" / "both" (a finished request's blocks are in the pool before its last output),
    # "consumer" (reads only)
    kv_role: str | None = None
    calculate_kv_scales: bool = False  # fp8 caches: K/V scales from the first batch (attention/kv_quant.py)

    def __post_init__(self):
        check_block_size(self.block_size)
        check_offload(self)
        if self.calculate_kv_scales and self.cache_dtype not in FP8_KV_CACHE_DTYPES.values():
            raise ValueError(f"calculate_kv_scales=True needs an fp8 kv_cache_dtype (one of "
                             f"{tuple(FP8_KV_CACHE_DTYPES)}); the cache dtype is {self.cache_dtype}")
        if self.calculate_kv_scales and (self.kv_offload_dir or self.kv_offload_remote):
            # the scales come from this run's first batch: blocks on disk from another run were
            # written with other scales, and the fingerprint cannot know them in advance
            raise ValueError(f"calculate_kv_scales=True cannot be combined with kv_offload_dir="
                             f"{self.kv_offload_dir!r} / kv_offload_remote={self.kv_offload_remote!r}; use the "
                             "checkpoint's K/V scales with a disk or remote tier")
        check_memory_utilization(self.gpu_memory_utilization)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark!r} must be in [0, 1)")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override!r} must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: str = "recompute"
    # "none" is PagedAttention. The others reserve KV up front at admission, like systems before
    # it: for max_model_len tokens, or for prompt + max_tokens ("request"). Benchmarks only.
    preallocation: str = "none"
    scheduling_policy: str = "fcfs"
    # LongRoPE (Phi-3): a request of more tokens than this computes its K/V with the long factors,
    # recomputed once when it grows past it (layers/rotary_variants.py); None: one factor set for all
    long_rope_from: int | None = None
    # vLLM's disable_chunked_mm_input: a chunk never ends inside an image's (a video's) placeholder
    # run; the whole run is scheduled in one step or waits (Gemma 3's bidirectional runs always do)
    disable_chunked_mm_input: bool = False

    def __post_init__(self):
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of {SCHEDULING_POLICIES}")
        if self.preallocation not in PREALLOCATION_MODES:
            raise ValueError(f"preallocation={self.preallocation!r} must be one of {PREALLOCATION_MODES}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be >= 1")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be one of {PREEMPTION_MODES}")


@dataclass(frozen=True)
class ParallelConfig:
    """TP x PP ranks (rank = stage * tensor_parallel_size + tp_rank), spread over ``nnodes``
    launches of ``world_size / nnodes`` ranks each; node ``n`` hosts ranks ``[n*k, (n+1)*k)``.
    Rank 0 (node 0) hosts the engine; ``master_addr:master_port`` is its rendezvous store
    (``master_port=0``: any free port, one node only)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    executor_backend: str = "mp"  # the other ranks: "mp" worker processes, "ray" Ray actors (executor/ray.py)

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be >= 1")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size!r} must be >= 1")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes!r} must be >= 1 and divide the world size tensor_parallel_size x "
                             f"pipeline_parallel_size = {self.world_size} (every node hosts as many ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank!r} must be in [0, nnodes={self.nnodes})")
        if self.executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend={self.executor_backend!r}: one of 'mp', 'ray'")
        if self.executor_backend == "ray" and self.nnodes > 1:
            raise ValueError(f"distributed_executor_backend='ray' places every rank on the Ray cluster from one "
                             f"launch: nnodes={self.nnodes} must be 1")
        if not 0 <= self.master_port < 65536 or (self.nnodes > 1 and self.master_port == 0):
            raise ValueError(f"master_port={self.master_port!r} must be in [1, 65535] (with nnodes > 1 every node "
                             "must be told the same port), or 0 on one node (any free port)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass(frozen=True)
class PoolerConfig:
    """``runner="pooling"``: how a prompt becomes one vector (vLLM's ``pooler_config``), from the
    final-normed hidden states of its tokens: LAST the last token's (what decoder embedding models
    such as e5-mistral and Qwen3-Embedding use), MEAN their mean, CLS the first token's;
    ``normalize`` scales it to unit L2 norm."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type={self.pooling_type!r} is not supported: one of "
                             f"{POOLING_TYPES}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize={self.normalize!r} must be true or false")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """What one request may ask of the grammar compiler (structured_output/): compile cost grows
    faster than linearly with a schema's size (16,000 properties: minutes), and a compile cannot be
    interrupted once it runs, so the spec's size is bounded up front and a request waits at most
    ``compile_timeout`` seconds for its grammar."""

    max_spec_bytes: int = 64 * 1024  # a JSON schema, regex, grammar or choice list larger is refused
    compile_timeout: float = 60.0  # seconds (queue + compile) before the request fails; 0: no limit

    def __post_init__(self):
        if not isinstance(self.max_spec_bytes, int) or self.max_spec_bytes <= 0:
            raise ValueError(f"max_structured_output_bytes={self.max_spec_bytes!r} must be a positive integer")
        if not self.compile_timeout >= 0:
            raise ValueError(f"structured_output_compile_timeout={self.compile_timeout!r} must be >= 0 "
                             "(0: no limit)")


LORA_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LoRAConfig:
    """``enable_lora``: adapter weights live in ``max_loras`` device slots of rank up to
    ``max_lora_rank`` (lora/), with up to ``max_cpu_loras`` adapters kept in host memory;
    ``lora_dtype`` is the slots' dtype ("auto": the model's)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras={cpu!r} must be an integer >= max_loras={self.max_loras}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype={self.lora_dtype!r} must be one of {LORA_DTYPES}")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.lora_dtype == "auto" else _DTYPES[self.lora_dtype]


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: torch.device
    attention_backend: str = "auto"
    num_threads: int | None = None
    log_stats_interval: float = 10.0
    compile_model: bool = False  # torch.compile each decoder layer (no gain measured on CPU)
    layer_ops: str = "native"  # the layers' fused ops, "native" or "triton" (layers/ops.py, resolved)
    cuda_graphs: bool = False  # capture decode steps in CUDA graphs (worker/cuda_graphs.py)
    speculative: SpeculativeConfig | None = None  # speculative decoding (spec_decode/), off when None
    pooler: PoolerConfig | None = None  # runner="pooling" (embeddings); None: the generate runner
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig | None = None  # enable_lora: multi-LoRA serving (lora/); None: off

    def __post_init__(self):
        n = self.num_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_threads={n!r} must be an integer >= 1 (or None: the physical cores, following "
                             "the free ones)")


def check_offload(cache: CacheConfig) -> None:
    """The KV tiers' settings: sizes >= 0, a disk budget exactly when there is a directory, and
    prefix caching on (the tiers hold prefix-cache blocks)."""
    for name in ("kv_offload_cpu_bytes", "kv_offload_disk_bytes"):
        if getattr(cache, name) < 0:
            raise ValueError(f"{name}={getattr(cache, name)!r} must be >= 0")
    if (cache.kv_offload_dir is None) != (cache.kv_offload_disk_bytes == 0):
        raise ValueError(f"kv_offload_dir={cache.kv_offload_dir!r} and kv_offload_disk_bytes="
                         f"{cache.kv_offload_disk_bytes!r}: a disk tier needs both a directory and a budget > 0")
    if cache.kv_offload_remote is not None:
        check_remote_url(cache.kv_offload_remote)
    if cache.kv_offload_remote_ttl_s is not None and (cache.kv_offload_remote is None
                                                      or cache.kv_offload_remote_ttl_s <= 0):
        raise ValueError(f"kv_offload_remote_ttl_s={cache.kv_offload_remote_ttl_s!r} must be > 0 and needs "
                         "kv_offload_remote")
    if cache.kv_role is not None and cache.kv_role not in KV_ROLES:
        raise ValueError(f"kv_role={cache.kv_role!r} is invalid: must be one of {KV_ROLES} (or unset)")
    if cache.kv_role is not None and cache.kv_offload_remote is None:
        raise ValueError(f"kv_role={cache.kv_role!r} needs kv_offload_remote (--kv-offload-remote "
                         "redis://host:port/db): prefill and decode replicas hand the KV over through that shared pool")
    if (cache.kv_offload_cpu_bytes or cache.kv_offload_dir or cache.kv_offload_remote) \
            and not cache.enable_prefix_caching:
        raise ValueError("the KV offload tiers (kv_offload_cpu_gb / kv_offload_dir / kv_offload_remote) hold "
                         "prefix-cache blocks: they need enable_prefix_caching=True")


# prefill/decode roles on the remote tier (vLLM's kv_transfer_config kv_role: kv_producer, kv_consumer, kv_both)
KV_ROLES = ("producer", "consumer", "both")
REMOTE_TIER_SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")  # rediss / valkeys: TLS
REMOTE_TIER_INSTALL_HINT = "the remote KV tier needs the redis client: pip install 'pagedllm[redis]'"


def check_remote_url(url: str) -> None:
    """``ValueError`` naming ``kv_offload_remote`` unless ``url`` has a scheme the Redis client
    speaks and the redis package is installed."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in REMOTE_TIER_SCHEMES:
        raise ValueError(f"kv_offload_remote={url!r}: expected a URL like redis://host:6379/0 (schemes: "
                         f"{', '.join(REMOTE_TIER_SCHEMES)}; rediss/valkeys for TLS, user:password@ for AUTH)")
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"kv_offload_remote={url!r}: {REMOTE_TIER_INSTALL_HINT}") from exc


def default_max_num_batched_tokens(device_type: str) -> int:
    """The step's token budget when max_num_batched_tokens is unset (the engine's and plan's)."""
    return 2048 if device_type == "cpu" else 8192


def check_block_size(block_size: int) -> int:
    if block_size not in ALLOWED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size!r} is not allowed; use one of {ALLOWED_BLOCK_SIZES}")
    return block_size


def check_memory_utilization(fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization={fraction!r} must be in (0, 1]")
    return fraction


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the canonical spelling in DTYPES)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (no fast half precision there), the checkpoint's dtype on CUDA.

    ``device`` is the device the model will run on; ``pagedllm plan`` passes the one it plans for
    (a GPU, by default), whatever machine it runs on.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# fp8: e4m3 with scales per layer or per layer and KV head (attention/kv_quant.py)
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = {"auto": None, **_DTYPES, **FP8_KV_CACHE_DTYPES}


def resolve_kv_cache_dtype(value: str) -> torch.dtype | None:
    """vLLM's ``kv_cache_dtype``: "auto" (the model's dtype) or a float type to store K/V in."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={value!r} is not supported; use one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[value]


def parse_gib(value: int | float | str, name: str) -> int:
    """A size in GiB as a number (vLLM's convention for ``swap_space`` and the KV-offload sizes)
    or a size string like '16GiB', as bytes; ``name`` is the parameter named in errors."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be a finite number of GiB >= 0")
        return int(value * 1024**3)
    try:
        gib = float(value)
    except (TypeError, ValueError):
        return parse_size(value, name)
    return parse_gib(gib, name)


def parse_swap_space(value: int | float | str) -> int:
    """``swap_space`` is GiB as a number (vLLM's convention) or a size string like '16GiB'."""
    return parse_gib(value, "swap_space")


def default_device() -> torch.device:
    forced = envs.PAGEDLLM_DEVICE
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
