"""User-facing engine arguments: the keywords ``LLM(...)`` takes and the CLI flags, from one declaration.

Each :class:`EngineArgs` field carries a :class:`CliOption` in its metadata (help, choices, aliases,
parse function, hidden, or the reason it is Python-only). :func:`add_engine_args` makes the argparse
flags from it and :meth:`EngineArgs.from_cli_args` maps the parsed namespace back, so a new field
appears on every command (generate, chat, serve) without being typed again. Choice lists are the
constants the configs validate against.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

import torch

from pagedllm import envs
from pagedllm.attention.selector import BACKENDS as ATTENTION_BACKENDS
from pagedllm.config import (
    ALLOWED_BLOCK_SIZES,
    DTYPES,
    KV_CACHE_DTYPES,
    PREALLOCATION_MODES,
    PREEMPTION_MODES,
    RUNNERS,
    SCHEDULING_POLICIES,
    TOKENIZER_MODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    default_device,
    parse_gib,
    parse_swap_space,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from pagedllm.distributed.pipeline import check_layers
from pagedllm.layers.ops import FUSED_OPS, resolve_fused_ops
from pagedllm.layers.quantization import METHODS as QUANTIZATION_METHODS
from pagedllm.layers.quantization import resolve_method as resolve_quantization
from pagedllm.models.loader import DEMO_MODEL_NAME, checkpoint_dtype, resolve_model_path
from pagedllm.models.registry import resolve_architecture
from pagedllm.spec_decode.config import SpeculativeConfig, check_draft_vocab, load_json_object, parse_speculative_config
from pagedllm.utils import parse_size


@dataclass(frozen=True)
class CliOption:
    """How one EngineArgs field appears on the command line (``--field-name``, plus any ``aliases``).

    A bool field is a switch: ``--flag`` when it defaults to False, ``--flag/--no-flag`` when it
    defaults to True. A field with ``python_only`` (the reason) gets no flag.
    """

    help: str
    choices: tuple | None = None
    parse: Callable[[str], Any] | None = None  # argparse ``type``; None keeps the string
    aliases: tuple[str, ...] = ()  # short forms, e.g. "-q"
    nargs: str | None = None
    hidden: bool = False  # accepted, but left out of --help
    python_only: str | None = None


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its command-line declaration (see CliOption)."""
    return field(default=default, metadata={"cli": CliOption(help, **kwargs)})


DEFAULT_DISK_GB = 10.0  # the disk tier's budget when --kv-offload-dir comes without --kv-offload-disk-gb


def cli_option(f: Field) -> CliOption:
    return f.metadata["cli"]


def _json_object_text(text: str, name: str = "speculative_config") -> str:
    """Checks a JSON-object flag value (argparse reports the error); keeps the text."""
    try:
        load_json_object(text, name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@dataclass
class EngineArgs:
    """Every engine option, with vLLM's names. ``create_engine_config`` validates and resolves them."""

    model: str = option(DEMO_MODEL_NAME, "local checkpoint directory, Hub id, or 'pagedllm-demo' (bundled)")
    tokenizer: str | None = option(None, "tokenizer path or Hub id (default: the model's)")
    tokenizer_mode: str = option("auto", "auto: the fast tokenizer when there is one; slow: the Python "
                                 "tokenizer (refused when the model has none)", choices=TOKENIZER_MODES)
    trust_remote_code: bool = option(False, "let transformers run the model repository's code for its config "
                                     "and tokenizer")
    dtype: str = option("auto", "weights and activations; auto = float32 on CPU, the checkpoint's half type on CUDA",
                        choices=DTYPES)
    block_size: int = option(16, "tokens per KV block", choices=ALLOWED_BLOCK_SIZES, parse=int)
    gpu_memory_utilization: float = option(
        0.9, "fraction of device memory (on CPU: of available RAM, capped) for weights, activations and KV",
        parse=float)
    kv_cache_memory: int | str | None = option(None, "KV cache size, bytes or e.g. '4GiB' (overrides utilization)")
    swap_space: float | str = option(4, "CPU swap space for preempted KV, GiB or e.g. '16GiB'")
    kv_offload_cpu_gb: float = option(0, "CPU memory (GiB, per rank; pinned on CUDA) for prefix blocks evicted "
                                      "from the KV cache, found again by later prompts", parse=float)
    kv_offload_dir: str | None = option(None, "directory for a disk tier below the CPU tier (kept across "
                                        "restarts; engines may share it); needs --kv-offload-disk-gb")
    kv_offload_disk_gb: float | None = option(None, "bytes (GiB) the disk tier may use in --kv-offload-dir, all "
                                              f"engines sharing it together (default {DEFAULT_DISK_GB:g})",
                                              parse=float)
    max_model_len: int | None = option(None, "context length (default: the model's)", parse=int)
    max_num_seqs: int = option(256, "sequences per step", parse=int)
    max_num_batched_tokens: int | None = option(None, "tokens per step (default 2048 CPU, 8192 GPU)", parse=int)
    enable_prefix_caching: bool = option(True, "reuse KV of shared prompt prefixes")
    preemption_mode: str = option("recompute", "what a preempted request loses: its KV (recompute) or its place "
                                  "on the device (swap to --swap-space)", choices=PREEMPTION_MODES)
    scheduling_policy: str = option("fcfs", "the order requests get the batch in: arrival (fcfs), or each "
                                    "request's priority, lowest value first, then arrival; it also picks "
                                    "the preempted request (the last in that order)", choices=SCHEDULING_POLICIES)
    seed: int = option(0, "engine random seed", parse=int)
    enforce_eager: bool = option(False, "never compile (overrides --compile-model) and capture no CUDA graphs")
    compile_model: bool = option(False, "torch.compile each decoder layer (start-up cost; no speed-up measured "
                                 "on CPU)")
    quantization: str | None = option(None, "weight-only projections: int8 (per-channel) or int4 (group 128) "
                                      "quantized at load, or the checkpoint's format (gptq, awq, "
                                      "compressed-tensors, fp8; detected from config.json)",
                                      choices=QUANTIZATION_METHODS, aliases=("-q",))
    kv_cache_dtype: str = option("auto", "KV cache storage; auto = the model's dtype; fp8 (= fp8_e4m3) and "
                                 "fp8_e5m2 store K/V in one byte with per-layer scales",
                                 choices=tuple(KV_CACHE_DTYPES))
    calculate_kv_scales: bool = option(False, "fp8 KV cache: set each layer's K/V scales from the first batch "
                                       "(max / 200 and max / 100, as vLLM) instead of the checkpoint's or 1.0")
    tensor_parallel_size: int = option(1, "number of tensor-parallel ranks", parse=int, aliases=("-tp",))
    pipeline_parallel_size: int = option(1, "number of pipeline stages (contiguous layer ranges; at most the "
                                         "model's layer count)", parse=int, aliases=("-pp",))
    nnodes: int = option(1, "number of nodes (launches) the TP x PP ranks are spread over; node 0 hosts the "
                         "engine, the others run `pagedllm serve MODEL --headless` (torchrun: WORLD_SIZE)", parse=int)
    node_rank: int = option(0, "this launch's node index in [0, nnodes) (torchrun: RANK)", parse=int)
    master_addr: str | None = option(None, "node 0's address, reachable from every node (default: MASTER_ADDR, "
                                     "else 127.0.0.1)")
    master_port: int | None = option(None, "node 0's rendezvous port (default: MASTER_PORT; required with nnodes > 1, "
                                     "else any free port)", parse=int)
    num_gpu_blocks_override: int | None = option(None, "force the number of KV blocks", parse=int)
    attention_backend: str = option("auto", "attention kernels; auto = the C kernel on CPU, Triton on CUDA",
                                    choices=ATTENTION_BACKENDS)
    num_threads: int | None = option(None, "torch threads on CPU (default: physical cores)", parse=int)
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    watermark: float = option(0.01, "fraction of KV blocks kept free when admitting requests", parse=float)
    disable_log_stats: bool = option(True, "no periodic throughput / KV-usage log lines")
    log_stats_interval: float = option(10.0, "seconds between stats log lines (with --no-disable-log-stats)",
                                       parse=float)
    max_logprobs: int = option(20, "most logprobs / prompt_logprobs a request may ask for (-1: the whole "
                               "vocabulary, which also allows logprobs=-1)", parse=int)
    generation_config: str = option(
        "auto", "sampling defaults for requests that leave them unset: auto = the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm = pagedllm's own, or a folder "
        "holding a generation_config.json")
    served_model_name: str | list[str] | None = option(
        None, "model name(s) clients use (default: the --model value)", nargs="+")
    fused_ops: str = option("auto", "norm/rotary/activation/sampling kernels: auto (Triton on CUDA), native "
                            "(C/torch), triton (everywhere; CPU only under TRITON_INTERPRET=1)", choices=FUSED_OPS)
    speculative_config: dict | str | None = option(
        None, 'speculative decoding, as JSON with vLLM\'s names: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT_DIR, "num_speculative_tokens": 4}',
        parse=_json_object_text)
    runner: str = option("generate", "generate: text generation; pooling: one vector per prompt (LLM.embed, "
                         "/v1/embeddings)", choices=RUNNERS)
    pooler_config: dict | str | None = option(
        None, 'runner pooling: as JSON, {"pooling_type": "LAST", "normalize": true} (the defaults)',
        parse=lambda text: _json_object_text(text, "pooler_config"))
    # benchmark knob: emulate contiguous pre-allocation (docs/architecture.md)
    preallocation: str = option("none", "benchmarks only: reserve KV up front like pre-PagedAttention systems",
                                choices=PREALLOCATION_MODES, hidden=True)
    enable_sleep_mode: bool = option(False, "allow LLM.sleep()/wake_up() and the server's /sleep, /wake_up and "
                                     "/is_sleeping: free the KV pool and offload or drop the weights between "
                                     "uses (RL loops)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs a command line parsed with :func:`add_engine_args` asks for."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if not cli_option(f).python_only})

    def create_engine_config(self) -> EngineConfig:
        device = default_device() if self.device == "auto" else torch.device(self.device)
        model_config = self._model_config(device)
        self._check_offload_layout()
        max_batched = self.max_num_batched_tokens or (2048 if device.type == "cpu" else 8192)
        layer_ops = resolve_fused_ops(self.fused_ops, device)
        if layer_ops == "triton" and device.type == "cpu" and self.compile_model and not self.enforce_eager:
            raise ValueError("compile_model=True cannot be combined with fused_ops='triton' on the CPU (torch.compile "
                             "cannot trace the Triton interpreter); use fused_ops='native' or leave compile_model off")
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=(None if self.kv_cache_memory is None
                                 else parse_size(self.kv_cache_memory, "kv_cache_memory")),
                swap_space=parse_swap_space(self.swap_space),
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                watermark=self.watermark,
                cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype),
                kv_offload_cpu_bytes=parse_gib(self.kv_offload_cpu_gb, "kv_offload_cpu_gb"),
                kv_offload_dir=self.kv_offload_dir,
                kv_offload_disk_bytes=self._disk_tier_bytes(),
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, max_batched, model_config.max_model_len, self.preemption_mode,
                                      self.preallocation, self.scheduling_policy),
            parallel=self._parallel_config(model_config),
            device=device,
            attention_backend=self.attention_backend,
            num_threads=self.num_threads,
            log_stats_interval=self._log_stats_interval(),
            compile_model=self.compile_model and not self.enforce_eager,
            layer_ops=layer_ops,
            cuda_graphs=device.type == "cuda" and not self.enforce_eager,
            speculative=self._speculative_config(device, model_config),
            pooler=self._pooler_config(),
        )

    def _pooler_config(self) -> PoolerConfig | None:
        """runner="pooling": its pooler (vLLM's pooler_config names); refused where it cannot run."""
        if self.runner == "generate":
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies to runner='pooling' only")
            return None
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} must be one of {RUNNERS}")
        for name, value, why in (("pipeline_parallel_size", self.pipeline_parallel_size != 1, "its last stage "
                                  "alone holds the hidden states"),
                                 ("speculative_config", self.speculative_config is not None, "nothing is decoded")):
            if value:
                raise ValueError(f"runner='pooling' cannot be combined with {name} ({why})")
        raw = self.pooler_config if self.pooler_config is not None else {}
        if isinstance(raw, str):
            raw = load_json_object(raw, "pooler_config")
        if not isinstance(raw, dict):
            raise TypeError(f"pooler_config must be a dict or its JSON text, got {type(raw).__name__}")
        unknown = sorted(set(raw) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config has unknown field(s) {unknown}; allowed: ['pooling_type', 'normalize']")
        return PoolerConfig(**raw)

    def _parallel_config(self, model_config: ModelConfig) -> ParallelConfig:
        """The TP x PP layout and where this launch sits; torchrun's WORLD_SIZE / RANK make each
        process one node of one rank."""
        nnodes, node_rank = self.nnodes, self.node_rank
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if envs.WORLD_SIZE is not None and (nnodes, node_rank) == (1, 0):
            if envs.WORLD_SIZE != world:
                raise ValueError(f"WORLD_SIZE={envs.WORLD_SIZE} (torchrun's process count) must equal "
                                 f"tensor_parallel_size x pipeline_parallel_size = {world}: one process per rank")
            nnodes, node_rank = world, envs.RANK or 0
        check_layers(model_config.num_layers, self.pipeline_parallel_size)
        port = self.master_port if self.master_port is not None else envs.MASTER_PORT
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, nnodes, node_rank,
                              self.master_addr or envs.MASTER_ADDR or "127.0.0.1", port or 0)

    def _check_offload_layout(self) -> None:
        # each pipeline stage would hold its own layers' share of a block, and the tiers agree on
        # a load's outcome only within a tensor-parallel group: not wired across stages yet
        if self.pipeline_parallel_size > 1 and (self.kv_offload_cpu_gb or self.kv_offload_dir):
            raise ValueError(f"kv_offload_cpu_gb={self.kv_offload_cpu_gb!r} / kv_offload_dir={self.kv_offload_dir!r} "
                             f"cannot be combined with pipeline_parallel_size={self.pipeline_parallel_size}: the KV "
                             "tiers work with pipeline_parallel_size=1 only")

    def _disk_tier_bytes(self) -> int:
        if self.kv_offload_dir is None:
            if self.kv_offload_disk_gb is not None:
                raise ValueError(f"kv_offload_disk_gb={self.kv_offload_disk_gb!r} needs kv_offload_dir (the "
                                 "directory of the disk tier)")
            return 0
        gib = DEFAULT_DISK_GB if self.kv_offload_disk_gb is None else self.kv_offload_disk_gb
        if gib == 0:
            raise ValueError("kv_offload_disk_gb=0 leaves the disk tier no room; leave kv_offload_dir unset instead")
        return parse_gib(gib, "kv_offload_disk_gb")

    def _speculative_config(self, device: torch.device, target: ModelConfig) -> SpeculativeConfig | None:
        """Parsed and checked; a draft model is resolved like the target (same dtype, context)."""
        spec = parse_speculative_config(self.speculative_config)
        if spec is None or spec.method != "draft_model":
            return spec
        args = dataclasses.replace(self, model=spec.model, tokenizer=None, quantization=None,
                                   max_model_len=target.max_model_len, speculative_config=None)
        try:
            draft = args._model_config(device)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from None
        check_draft_vocab(draft.vocab_size, target.vocab_size, spec.model)
        return dataclasses.replace(spec, draft=dataclasses.replace(draft, dtype=target.dtype))

    def _model_config(self, device: torch.device) -> ModelConfig:
        from transformers import AutoConfig
        path = resolve_model_path(self.model)
        hf = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        arch = resolve_architecture(getattr(hf, "architectures", None), self.runner)
        limit = getattr(hf, "max_position_embeddings", None) or 2048
        max_len = self.max_model_len or limit
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer")
        if max_len > limit and not envs.PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}")
        heads = hf.num_attention_heads
        return ModelConfig(
            model=path,
            tokenizer=resolve_model_path(self.tokenizer) if self.tokenizer else path,
            hf_config=hf,
            architecture=arch,
            dtype=resolve_dtype(self.dtype, checkpoint_dtype(path), device),
            max_model_len=max_len,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            seed=self.seed,
            quantization=resolve_quantization(self.quantization, hf),
            tokenizer_mode=self.tokenizer_mode,
            trust_remote_code=self.trust_remote_code,
            served_model_names=self.served_model_names(),
            max_logprobs=self.max_logprobs,
            generation_defaults=generation_defaults(path, self.generation_config),
            enable_sleep_mode=self.enable_sleep_mode,
        )

    def served_model_names(self) -> tuple[str, ...]:
        """``served_model_name`` as a tuple; the model as given when unset."""
        names = self.served_model_name or self.model
        return (names,) if isinstance(names, str) else tuple(names)

    def _log_stats_interval(self) -> float:
        """0 turns the stats log off (``disable_log_stats``)."""
        if self.disable_log_stats:
            return 0
        if not self.log_stats_interval > 0:
            raise ValueError(f"log_stats_interval={self.log_stats_interval!r} must be > 0 seconds")
        return self.log_stats_interval


# generation_config.json keys vLLM takes as sampling defaults -> SamplingParams fields
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str, source: str) -> tuple[tuple[str, Any], ...]:
    """The sampling defaults ``generation_config`` asks for: those the model's (or a folder's)
    generation_config.json sets to non-default values ("auto"), or none ("vllm")."""
    if source == "vllm":
        return ()
    from transformers import GenerationConfig
    folder = model_path if source == "auto" else source
    try:
        diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    except OSError:
        if source == "auto":
            return ()  # the model has no generation_config.json: nothing to apply
        raise ValueError(f"generation_config={source!r} must be 'auto', 'vllm' or a folder holding a "
                         "generation_config.json") from None
    return tuple((ours, diff[hf]) for hf, ours in _GENERATION_FIELDS.items() if diff.get(hf) is not None)


def add_engine_args(parser: argparse.ArgumentParser, names: Sequence[str] | None = None,
                    title: str = "engine") -> None:
    """Adds one flag per EngineArgs field (vLLM's names) to ``parser``, from the fields' CliOption.

    ``names`` picks a subset of fields (a benchmark exposing a few engine options); default: all.
    """
    chosen = [f for f in fields(EngineArgs) if not cli_option(f).python_only]
    if names is not None:
        unknown = set(names) - {f.name for f in chosen}
        if unknown:
            raise ValueError(f"names={sorted(unknown)} are not EngineArgs fields with a flag")
        chosen = [f for f in chosen if f.name in names]
    group = parser.add_argument_group(title)
    for f in chosen:
        opt = cli_option(f)
        group.add_argument(*_flag_names(f.name, opt), dest=f.name, default=f.default, **_argparse_kwargs(f, opt))


def _flag_names(name: str, opt: CliOption) -> list[str]:
    return ["--" + name.replace("_", "-"), *opt.aliases]


def _argparse_kwargs(f: Field, opt: CliOption) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": argparse.SUPPRESS if opt.hidden else opt.help}
    if isinstance(f.default, bool):  # a switch: --flag, or --flag/--no-flag when on by default
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        return kwargs
    extra = {"choices": opt.choices, "type": opt.parse, "nargs": opt.nargs}
    return kwargs | {key: value for key, value in extra.items() if value is not None}


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """Same as :meth:`EngineArgs.from_cli_args` (the name the entry points import)."""
    return EngineArgs.from_cli_args(args)
