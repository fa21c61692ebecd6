"""User-facing engine arguments: the keywords ``LLM(...)`` takes and the CLI flags, from one declaration.

Each :class:`EngineArgs` field carries a :class:`CliOption` in its metadata (help, choices, aliases,
parse function, hidden, or the reason it is Python-only). :func:`add_engine_args` makes the argparse
flags from it and :meth:`EngineArgs.from_cli_args` maps the parsed namespace back, so a new field
appears on every command (generate, chat, serve) without being typed again. Choice lists are the
constants the configs validate against.

vLLM's names (engine/vllm_engine_args.json, engine/vllm_args.py): EngineArgs declares the ones it
honours; every other name vLLM's EngineArgs / LLM accepts becomes a field from that table, accepted
at the values that change nothing here and refused (ValueError, with the reason) at any other, with
its vLLM flag in a "vLLM compatibility" group. An unknown keyword is a TypeError naming the closest.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import warnings
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
    KV_ROLES,
    LORA_DTYPES,
    PREALLOCATION_MODES,
    PREEMPTION_MODES,
    RUNNERS,
    SCHEDULING_POLICIES,
    TOKENIZER_MODES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    StructuredOutputConfig,
    default_device,
    default_max_num_batched_tokens,
    parse_gib,
    parse_swap_space,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from pagedllm.contracts.speculative_config import (
    SpeculativeConfig,
    check_draft_vocab,
    load_json_object,
    parse_speculative_config,
)
from pagedllm.distributed.pipeline import check_layers
from pagedllm.engine.vllm_args import VllmArg, unknown_keyword_error, vllm_args, vllm_version
from pagedllm.kv_cache.offload.kv_transfer import CONNECTOR as KV_CONNECTOR
from pagedllm.kv_cache.offload.kv_transfer import kv_role_from_transfer_config, normalize_kv_role
from pagedllm.layers.ops import FUSED_OPS, resolve_fused_ops
from pagedllm.layers.quantization import METHODS as QUANTIZATION_METHODS
from pagedllm.layers.quantization import resolve_method as resolve_quantization
from pagedllm.layers.rotary_variants import long_rope_offset
from pagedllm.models.loader import (
    DEMO_MODEL_NAME,
    LOAD_FORMATS,
    HubOptions,
    apply_hf_overrides,
    checkpoint_dtype,
    get_model_class,
    resolve_model_path,
)
from pagedllm.models.registry import resolve_architecture
from pagedllm.models.shape import model_shape
from pagedllm.multimodal.processor import check_limit_mm_per_prompt
from pagedllm.multimodal.processor_cache import check_cache_gb
from pagedllm.utils import parse_size

EXECUTOR_BACKENDS = ("mp", "uni", "ray")  # vLLM's distributed_executor_backend names pagedllm runs


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
    const: Any = None  # with nargs="?": the value of the bare flag


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its command-line declaration (see CliOption)."""
    return field(default=default, metadata={"cli": CliOption(help, **kwargs)})


DEFAULT_DISK_GB = 10.0  # the disk tier's budget when --kv-offload-dir comes without --kv-offload-disk-gb
# vLLM's ``convert``: "embed" runs a *ForCausalLM as an embedding model (our pooling runner);
# "classify" is a *ForSequenceClassification checkpoint's own head (vLLM also converts causal LMs: not here)
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM < 0.11's ``task`` -> (runner, convert)
TASKS = {"auto": ("auto", "auto"), "generate": ("generate", "auto"), "embed": ("pooling", "embed"),
         "embedding": ("pooling", "embed"), "classify": ("pooling", "classify"), "score": ("pooling", "classify"),
         "reward": ("pooling", "auto")}


def cli_option(f: Field) -> CliOption:
    return f.metadata["cli"]


def _json_object_text(text: str, name: str = "speculative_config") -> str:
    """Checks a JSON-object flag value (argparse reports the error); keeps the text."""
    try:
        load_json_object(text, name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _json_object(name: str) -> Callable[[str], dict]:
    """A flag whose value is a JSON object (``--hf-overrides '{"rope_theta": 1e6}'``), parsed."""
    def parse(text: str) -> dict:
        try:
            return load_json_object(text, name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _json_object_or_text(value: dict | str | None, name: str) -> dict:
    """A dict keyword, or its JSON text; None is empty."""
    if value is None:
        return {}
    if isinstance(value, str):
        return load_json_object(value, name)
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict (or its JSON text)")
    return value


def _media_path(path: str | None) -> str | None:
    """``allowed_local_media_path`` as an existing directory's real path (None: no local files)."""
    if not path:
        return None
    if not os.path.isdir(path):
        raise ValueError(f"allowed_local_media_path={path!r} is not an existing directory")
    return os.path.realpath(path)


def _vllm_field(arg: VllmArg) -> Any:
    """The EngineArgs field of a vLLM name pagedllm does not declare: vLLM's default, and its flag."""
    default = arg.default
    opt = CliOption(_vllm_help(arg), python_only=arg.cli, aliases=arg.flags[1:], **_VALUE_FLAGS[arg.type])
    metadata = {"cli": opt, "vllm": arg}
    if isinstance(default, (dict, list)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _vllm_help(arg: VllmArg) -> str:
    label = "deprecated in vLLM; " if arg.status == "deprecated" else ""
    if arg.field:  # mapped onto one of ours (task -> runner / convert)
        return f"{label}{arg.reason}".replace("%", "%%")
    accepted = " / ".join("unset" if v is None else json.dumps(v) for v in arg.accept)
    return f"{label}accepted: {accepted}; {arg.reason}".replace("%", "%%")


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """vLLM's optional_type: "None" is None (argparse also runs this on a string default, kept as is)."""
    return lambda text: None if text == "None" else parse(text)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # vLLM keeps a non-JSON value as its text (then refused here by value)


_VALUE_FLAGS: dict[str, dict[str, Any]] = {  # a vLLM value type -> its flag (CliOption fields)
    "bool": {"parse": bool}, "bool_or_str": {"nargs": "?", "const": True, "parse": _optional(str)},
    "int": {"parse": _optional(int)}, "float": {"parse": _optional(float)}, "str": {"parse": _optional(str)},
    "json": {"parse": _json_value}, "list": {"nargs": "+"}, "list_int": {"nargs": "+", "parse": int},
}


def _with_vllm_fields(cls: type) -> type:
    """Declares, before ``@dataclass`` runs, one field for every vLLM keyword ``cls`` does not declare."""
    for arg in vllm_args().values():
        if arg.name not in cls.__annotations__ and not arg.llm_only:
            cls.__annotations__[arg.name] = "Any"
            setattr(cls, arg.name, _vllm_field(arg))
    return cls


def _refuse_unknown_keywords(cls: type) -> type:
    """Wraps the dataclass ``__init__``: an unknown keyword is a TypeError naming the closest valid one."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in names:
                raise unknown_keyword_error(name, names, cls.__name__)
        init(self, *args, **kwargs)
    cls.__init__ = __init__
    return cls


@_refuse_unknown_keywords
@dataclass
@_with_vllm_fields
class EngineArgs:
    """Every engine option, with vLLM's names. ``create_engine_config`` validates and resolves them.

    The fields declared here are pagedllm's options (most with vLLM's names and meanings); the
    other names of vLLM's EngineArgs come from engine/vllm_engine_args.json (``_with_vllm_fields``)."""

    model: str = option(DEMO_MODEL_NAME, "local checkpoint directory, Hub id, or 'pagedllm-demo' (bundled)")
    tokenizer: str | None = option(None, "tokenizer path or Hub id (default: the model's)")
    tokenizer_mode: str = option("auto", "auto (or vLLM's hf): the fast tokenizer when there is one; slow: the "
                                 "Python tokenizer (refused when the model has none)",
                                 choices=(*TOKENIZER_MODES, "hf"))
    trust_remote_code: bool = option(False, "let transformers run the model repository's code for its config "
                                     "and tokenizer")
    dtype: str = option("auto", "weights and activations; auto = float32 on CPU, the checkpoint's half type on CUDA",
                        choices=DTYPES)
    block_size: int | None = option(16, "tokens per KV block (None: 16)", choices=ALLOWED_BLOCK_SIZES, parse=int)
    gpu_memory_utilization: float = option(
        0.9, "fraction of device memory (on CPU: of available RAM, capped) for weights, activations and KV",
        parse=float, aliases=("--device-memory-utilization",))
    kv_cache_memory: int | str | None = option(None, "KV cache size, bytes or e.g. '4GiB' (overrides utilization)")
    kv_cache_memory_bytes: int | None = option(None, "vLLM's spelling of --kv-cache-memory, in bytes", parse=int)
    swap_space: float | str = option(4, "CPU swap space for preempted KV, GiB or e.g. '16GiB'")
    kv_offload_cpu_gb: float = option(0, "CPU memory (GiB, per rank; pinned on CUDA) for prefix blocks evicted "
                                      "from the KV cache, found again by later prompts", parse=float)
    kv_offload_dir: str | None = option(None, "directory for a disk tier below the CPU tier (kept across "
                                        "restarts; engines may share it); needs --kv-offload-disk-gb")
    kv_offload_disk_gb: float | None = option(None, "bytes (GiB) the disk tier may use in --kv-offload-dir, all "
                                              f"engines sharing it together (default {DEFAULT_DISK_GB:g})",
                                              parse=float)
    kv_offload_remote: str | None = option(None, "Redis/Valkey URL of a remote tier below the CPU and disk tiers, "
                                           "shared by replicas: redis://[user:password@]host:6379/0 (rediss:// for "
                                           "TLS, valkey://); bounded by the server's maxmemory policy and "
                                           "--kv-offload-remote-ttl")
    kv_offload_remote_ttl: int | None = option(None, "seconds each block lives in --kv-offload-remote (default: "
                                               "until the server evicts it)", parse=int)
    kv_role: str | None = option(None, "prefill/decode disaggregation on --kv-offload-remote: producer (a finished "
                                 "request's blocks are in the pool before its response ends), consumer (reads the "
                                 "pool, never writes it), both (as producer; a router may send it either)",
                                 choices=KV_ROLES)
    kv_transfer_config: dict | str | None = option(
        None, 'vLLM\'s form of --kv-role, as JSON: \'{"kv_role": "kv_producer"}\' (kv_consumer, kv_both); '
        f"kv_connector unset or {KV_CONNECTOR!r} (other connectors are refused)", parse=str)
    max_model_len: int | None = option(None, "context length (default: the model's)", parse=int)
    max_num_seqs: int | None = option(256, "sequences per step (None: 256)", parse=int)
    max_num_batched_tokens: int | None = option(None, "tokens per step (default 2048 CPU, 8192 GPU); a longer "
                                                "prompt is prefilled in chunks of this size", parse=int)
    enable_chunked_prefill: bool | None = option(
        None, "pagedllm always chunks prompts longer than --max-num-batched-tokens: true or unset; false is "
        "refused", parse=bool)
    enable_prefix_caching: bool | None = option(True, "reuse KV of shared prompt prefixes (None: on)")
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
                                      "compressed-tensors, fp8, mxfp4; detected from config.json)",
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
    attention_backend: str | None = option("auto", "attention kernels; auto (or None) = the C kernel on CPU, "
                                           "Triton on CUDA", choices=ATTENTION_BACKENDS)
    num_threads: int | None = option(None, "OpenMP threads on CPU, torch's and the C kernels' (default: the "
                                     "physical cores, then as many as other processes leave free; "
                                     "PAGEDLLM_CPU_OMP_THREADS_BIND)", parse=int, aliases=("--cpu-threads",))
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
                         "/v1/embeddings); auto: pooling for checkpoints that only pool (a bare *Model), else "
                         "generate", choices=("auto", *RUNNERS))
    convert: str = option("auto", "vLLM's model conversion: embed runs a *ForCausalLM as an embedding model "
                          "(runner pooling); classify needs a *ForSequenceClassification checkpoint; none/auto: "
                          "as the checkpoint is", choices=CONVERTS)
    pooler_config: dict | str | None = option(
        None, 'runner pooling: as JSON, {"pooling_type": "LAST", "normalize": true} (the defaults)',
        parse=lambda text: _json_object_text(text, "pooler_config"))
    spec_method: str | None = option(None, "vLLM's shorthand for speculative_config's method (ngram, "
                                     "draft_model)")
    spec_model: str | None = option(None, "shorthand for speculative_config's draft model")
    spec_tokens: int | None = option(None, "shorthand for speculative_config's num_speculative_tokens", parse=int)
    revision: str | None = option(None, "the Hub revision (branch, tag or commit) of the model to download; "
                                  "a local directory is used as it is")
    hf_config_path: str | None = option(None, "read config.json from this directory or Hub id instead of the "
                                        "model's")
    tokenizer_revision: str | None = option(None, "the Hub revision of the tokenizer (default: the model's)")
    download_dir: str | None = option(None, "where Hub downloads go (default: the Hugging Face cache)")
    hf_token: bool | str | None = option(None, "the Hub token (True: the one `huggingface-cli login` saved)",
                                         nargs="?", const=True)
    hf_overrides: dict | Callable | None = option(
        None, 'config.json values to override, as JSON ({"rope_theta": 1e6}; a dict value updates a nested '
        "config), or in Python a function from the config to the config", parse=_json_object("hf_overrides"))
    allowed_local_media_path: str = option(
        "", "a directory whose files chat requests may send as file:// image URLs (default: none may)")
    allowed_media_domains: list[str] | None = option(
        None, "hosts whose http(s) image URLs chat requests may send (default: none; data: URLs always work)",
        nargs="+")
    limit_mm_per_prompt: dict | None = option(
        None, 'most items of each modality one prompt may carry, as JSON ({"image": 4}); more are refused',
        parse=_json_object("limit_mm_per_prompt"))
    mm_processor_kwargs: dict | None = option(
        None, 'options for the model\'s Hugging Face image processor, as JSON ({"size": {"shortest_edge": 336}}); '
        "a request's own mm_processor_kwargs override them", parse=_json_object("mm_processor_kwargs"))
    mm_processor_cache_gb: float = option(
        4.0, "GiB of recent images' and videos' processor outputs kept by content, so a repeated image skips "
        "the image processor (0 disables)", parse=float)
    disable_chunked_mm_input: bool = option(
        False, "never split an image's (a video's) placeholder tokens across prefill chunks: a chunk stops before "
        "the item, which runs whole in a later step (an item longer than --max-num-batched-tokens is refused)")
    language_model_only: bool = option(
        False, "a vision-language model's language model alone: its vision tower and projector are not loaded "
        "and prompts with images or videos are refused")
    skip_mm_profiling: bool = option(
        False, "start faster: the start-up memory profile runs no image through the vision tower, so the KV cache "
        "leaves no room for its activations (size --gpu-memory-utilization / --kv-cache-memory for them)")
    load_format: str = option("auto", "auto / safetensors: the *.safetensors weights (pickled checkpoints are "
                              "never loaded); dummy: random weights, for benchmarks", choices=LOAD_FORMATS)
    override_generation_config: dict | None = option(
        None, 'generation_config.json values to override (HF names), as JSON: {"temperature": 0.5}',
        parse=_json_object("override_generation_config"))
    kv_offloading_size: float | None = option(None, "vLLM's CPU KV offloading buffer in GiB, across all ranks "
                                              "(pagedllm's --kv-offload-cpu-gb is per rank)", parse=float)
    distributed_executor_backend: str | None = option(
        None, "how the ranks other than rank 0 run when tensor_parallel_size x pipeline_parallel_size > 1: mp "
        "(default: worker processes), ray (Ray actors in a placement group, on the Ray cluster this process "
        "reaches or a local one; pip install 'pagedllm[ray]'), uni (one rank only)", choices=EXECUTOR_BACKENDS)
    kv_offloading_backend: str = option("native", "vLLM's KV offloading backend: native (pagedllm's CPU tier)",
                                        choices=("native",))
    # benchmark knob: emulate contiguous pre-allocation (docs/design.md)
    preallocation: str = option("none", "benchmarks only: reserve KV up front like pre-PagedAttention systems",
                                choices=PREALLOCATION_MODES, hidden=True)
    max_structured_output_bytes: int = option(
        StructuredOutputConfig.max_spec_bytes, "largest JSON schema / regex / grammar / choice list a request may "
        "constrain its output with, in bytes (compile cost grows faster than the spec; a larger one is refused)",
        parse=int)
    structured_output_compile_timeout: float = option(
        StructuredOutputConfig.compile_timeout, "seconds a request waits for its grammar to compile (queue "
        "included) before it fails; 0: no limit", parse=float)
    enable_sleep_mode: bool = option(False, "allow LLM.sleep()/wake_up() and the server's /sleep, /wake_up and "
                                     "/is_sleeping: free the KV pool and offload or drop the weights between "
                                     "uses (RL loops)")
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT checkpoints) over the base model: requests name "
                               "one with lora_request= (offline) or model= (server)")
    max_loras: int = option(1, "adapters resident on the device at once (one slot each); a request whose adapter "
                            "finds no free slot waits", parse=int)
    max_lora_rank: int = option(16, "largest adapter rank r the slots hold", parse=int)
    max_cpu_loras: int | None = option(None, "adapters kept in host memory, laid out for the slots (default: "
                                       "--max-loras)", parse=int)
    lora_dtype: str = option("auto", "the adapter slots' dtype; auto = the model's", choices=LORA_DTYPES)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's spelling of :func:`add_engine_args` (``EngineArgs.add_cli_args(parser)`` in its examples)."""
        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs a command line parsed with :func:`add_engine_args` asks for."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if not cli_option(f).python_only})

    def create_engine_config(self) -> EngineConfig:
        return self._as_pagedllm()._engine_config()

    def _as_pagedllm(self) -> EngineArgs:
        """These arguments with vLLM's spellings of our options made ours (None for our default, the
        ``spec_*`` shorthand, bytes / GiB across ranks), after refusing what cannot be honoured."""
        self._check_vllm_values()
        if self.enable_chunked_prefill is False:
            raise ValueError("enable_chunked_prefill=False is not supported: pagedllm's scheduler always prefills "
                             "a prompt longer than the step's token budget in chunks; raise max_num_batched_tokens "
                             "to prefill longer prompts in one step")
        runner, convert = self._runner_and_convert()
        return dataclasses.replace(
            self, runner=runner, convert=convert, task="auto", seed=0 if self.seed is None else self.seed,
            block_size=16 if self.block_size is None else self.block_size,
            max_num_seqs=256 if self.max_num_seqs is None else self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching is not False,
            attention_backend=self.attention_backend or "auto",
            tokenizer_mode="auto" if self.tokenizer_mode == "hf" else self.tokenizer_mode,
            kv_cache_memory=self._kv_cache_memory(), kv_cache_memory_bytes=None,
            kv_offload_cpu_gb=self._kv_offload_cpu_gb(), kv_offloading_size=None,
            speculative_config=self._speculative_from_shorthand(), spec_method=None, spec_model=None, spec_tokens=None)

    def _check_vllm_values(self) -> None:
        """vLLM's names pagedllm does not declare: refused at any value but the accepted ones."""
        for arg in vllm_args().values():
            if arg.status == "honoured" or arg.llm_only or arg.field:
                continue
            value = getattr(self, arg.name)
            if not arg.accepts(value):
                raise ValueError(arg.refusal(value))
            if arg.status == "deprecated" and value != arg.default:
                warnings.warn(f"{arg.name}={value!r} is deprecated in vLLM: {arg.reason}", DeprecationWarning,
                              stacklevel=4)
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is not supported: "
                             f"one of {EXECUTOR_BACKENDS} (or None: 'mp' for more than one rank)")
        if self.distributed_executor_backend == "uni" and world > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in this process; "
                             f"tensor_parallel_size x pipeline_parallel_size = {world} needs 'mp' (or unset)")

    def _runner_and_convert(self) -> tuple[str, str]:
        """``runner`` / ``convert``, with vLLM < 0.11's ``task`` mapped onto them; "auto" runner is
        decided by the checkpoint's architecture."""
        runner, convert = self.runner, self.convert
        if self.task != "auto":
            if self.task not in TASKS:
                raise ValueError(f"task={self.task!r} is not supported: one of {sorted(TASKS)}")
            warnings.warn(f"task={self.task!r} is deprecated in vLLM: use runner= / convert=", DeprecationWarning,
                          stacklevel=4)
            task_runner, task_convert = TASKS[self.task]
            if runner not in ("generate", "auto", task_runner) or convert not in ("auto", task_convert):
                raise ValueError(f"task={self.task!r} means runner={task_runner!r}, convert={task_convert!r}; it "
                                 f"contradicts runner={runner!r}, convert={convert!r}")
            runner, convert = task_runner, task_convert
        if convert in ("embed", "classify"):
            runner = "pooling"  # vLLM's conversions make a pooling model
        if runner == "auto":
            runner = self._auto_runner()
        return runner, convert

    def _auto_runner(self) -> str:
        """vLLM's runner="auto": pooling for a checkpoint only the pooling runner can load, else generate."""
        archs = getattr(self._hf_config(resolve_model_path(self.model, self._hub())), "architectures", None)
        try:
            resolve_architecture(archs, "generate")
            return "generate"
        except ValueError:
            return "pooling"

    def _kv_cache_memory(self) -> int | str | None:
        if self.kv_cache_memory_bytes is None:
            return self.kv_cache_memory
        if self.kv_cache_memory is not None:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} and kv_cache_memory="
                             f"{self.kv_cache_memory!r} set the same thing: give one")
        return self.kv_cache_memory_bytes

    def _kv_offload_cpu_gb(self) -> float:
        """vLLM's ``kv_offloading_size`` is GiB across all ranks; ours is per rank."""
        if self.kv_offloading_size is None:
            return self.kv_offload_cpu_gb
        if self.kv_offload_cpu_gb:
            raise ValueError(f"kv_offloading_size={self.kv_offloading_size!r} and kv_offload_cpu_gb="
                             f"{self.kv_offload_cpu_gb!r} set the same CPU tier: give one")
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend={self.kv_offloading_backend!r} is not supported: 'native' "
                             "(pagedllm's CPU tier)")
        return self.kv_offloading_size / (self.tensor_parallel_size * self.pipeline_parallel_size)

    def _speculative_from_shorthand(self) -> dict | str | None:
        """vLLM's ``spec_method`` / ``spec_model`` / ``spec_tokens`` as a speculative_config."""
        short = {"method": self.spec_method, "model": self.spec_model, "num_speculative_tokens": self.spec_tokens}
        short = {key: value for key, value in short.items() if value is not None}
        if not short:
            return self.speculative_config
        if self.speculative_config is not None:
            raise ValueError(f"spec_method / spec_model / spec_tokens ({short}) are a shorthand for "
                             "speculative_config: give one or the other")
        return short

    def _hub(self) -> HubOptions:
        return HubOptions(self.revision, self.download_dir, self.hf_token)

    def _hf_config(self, path: str):
        """The checkpoint's config.json, with ``hf_overrides`` applied."""
        from transformers import AutoConfig
        if self.hf_config_path is not None:
            path = resolve_model_path(self.hf_config_path, self._hub())
        hf = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        return apply_hf_overrides(hf, self.hf_overrides)

    def _engine_config(self) -> EngineConfig:
        device = default_device() if self.device == "auto" else torch.device(self.device)
        model_config = self._model_config(device)
        self._check_offload_layout()
        max_batched = self.max_num_batched_tokens or default_max_num_batched_tokens(device.type)
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
                kv_offload_remote=self.kv_offload_remote,
                kv_offload_remote_ttl_s=self.kv_offload_remote_ttl,
                kv_role=self._kv_role(),
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, max_batched, model_config.max_model_len, self.preemption_mode,
                                      self.preallocation, self.scheduling_policy,
                                      self._long_rope_from(model_config), self.disable_chunked_mm_input),
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
            structured_output=StructuredOutputConfig(self.max_structured_output_bytes,
                                                     self.structured_output_compile_timeout),
            lora=self._lora_config(model_config),
        )

    def _lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        """enable_lora: the adapter slots; refused where the adapter mapping cannot follow the batch."""
        if not self.enable_lora:
            return None
        if getattr(get_model_class(model_config.architecture), "is_multimodal", False):
            raise ValueError(f"enable_lora=True is not supported for {model_config.architecture} (a vision-language "
                             "model): adapters on its language model and tower are not wired yet")
        for name, value, why in (
                ("pipeline_parallel_size", self.pipeline_parallel_size != 1, "the adapter mapping is set for "
                 "the whole batch, not per micro-batch"),
                ("compile_model", self.compile_model and not self.enforce_eager, "the adapters' per-step mapping "
                 "would recompile the layers")):
            if value:
                raise ValueError(f"enable_lora=True cannot be combined with {name}={getattr(self, name)!r} ({why})")
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras,
                          "auto" if self.lora_dtype in (None, "auto") else str(self.lora_dtype).removeprefix("torch."))

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
        backend = "ray" if self.distributed_executor_backend == "ray" else "mp"
        if backend == "ray":
            from pagedllm.worker.executor.ray import import_ray  # Ray itself is an optional extra
            import_ray()  # refused here, with the install hint, when Ray is missing
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, nnodes, node_rank,
                              self.master_addr or envs.MASTER_ADDR or "127.0.0.1", port or 0, backend)

    def _check_offload_layout(self) -> None:
        # each pipeline stage would hold its own layers' share of a block, and the tiers agree on
        # a load's outcome only within a tensor-parallel group: not wired across stages yet
        if self.pipeline_parallel_size > 1 and (self.kv_offload_cpu_gb or self.kv_offload_dir
                                                or self.kv_offload_remote):
            raise ValueError(f"kv_offload_cpu_gb={self.kv_offload_cpu_gb!r} / kv_offload_dir={self.kv_offload_dir!r} "
                             f"/ kv_offload_remote={self.kv_offload_remote!r} "
                             f"cannot be combined with pipeline_parallel_size={self.pipeline_parallel_size}: the KV "
                             "tiers work with pipeline_parallel_size=1 only")

    def _kv_role(self) -> str | None:
        """``kv_role``, or vLLM's ``kv_transfer_config`` kv_role (the two must agree when both are set)."""
        role = normalize_kv_role(self.kv_role)
        from_json = kv_role_from_transfer_config(self.kv_transfer_config)
        if role is not None and from_json is not None and role != from_json:
            raise ValueError(f"kv_role={self.kv_role!r} contradicts kv_transfer_config's kv_role ({from_json!r}): "
                             "set one of them")
        return role or from_json

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

    @staticmethod
    def _long_rope_from(model_config: ModelConfig) -> int | None:
        """LongRoPE's switch point for the scheduler (SchedulerConfig.long_rope_from), None without one."""
        hf = model_config.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        return long_rope_offset(text, model_config.max_model_len)

    def _model_config(self, device: torch.device) -> ModelConfig:
        path = resolve_model_path(self.model, self._hub())
        hf = self._hf_config(path)
        arch = resolve_architecture(getattr(hf, "architectures", None), self.runner)
        if self.convert == "classify" and not arch.endswith("ForSequenceClassification"):
            raise ValueError(f"convert='classify' is not supported for {arch}: pagedllm classifies with a "
                             "*ForSequenceClassification checkpoint's own head (it does not add one to a causal LM)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not supported: one of {LOAD_FORMATS} (pickled "
                             "'pt' checkpoints are never loaded)")
        shape = model_shape(hf.to_dict())  # a vision-language model's decoder: its text_config
        limit = shape.max_position_embeddings or 2048
        max_len = self.max_model_len or limit
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer")
        if max_len > limit and not envs.PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}")
        return ModelConfig(
            model=path,
            tokenizer=self._tokenizer_path(path),
            hf_config=hf,
            architecture=arch,
            dtype=resolve_dtype(self.dtype, checkpoint_dtype(path), device),
            max_model_len=max_len,
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            seed=self.seed,
            quantization=resolve_quantization(self.quantization, hf),
            tokenizer_mode=self.tokenizer_mode,
            trust_remote_code=self.trust_remote_code,
            served_model_names=self.served_model_names(),
            max_logprobs=self.max_logprobs,
            generation_defaults=generation_defaults(path, self.generation_config, self.override_generation_config),
            enable_sleep_mode=self.enable_sleep_mode,
            load_format=self.load_format,
            limit_mm_per_prompt=check_limit_mm_per_prompt(_json_object_or_text(self.limit_mm_per_prompt,
                                                                                "limit_mm_per_prompt")),
            allowed_local_media_path=_media_path(self.allowed_local_media_path),
            allowed_media_domains=tuple(self.allowed_media_domains or ()),
            mm_processor_kwargs=tuple(_json_object_or_text(self.mm_processor_kwargs, "mm_processor_kwargs").items()),
            mm_processor_cache_gb=check_cache_gb(self.mm_processor_cache_gb),
            language_model_only=self.language_model_only,
            skip_mm_profiling=self.skip_mm_profiling,
        )

    def _tokenizer_path(self, model_path: str) -> str:
        """The tokenizer's directory: the model's, unless another tokenizer or revision is asked for."""
        if self.tokenizer is None and self.tokenizer_revision in (None, self.revision):
            return model_path
        hub = dataclasses.replace(self._hub(), revision=self.tokenizer_revision or self.revision)
        return resolve_model_path(self.tokenizer or self.model, hub)

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


def generation_defaults(model_path: str, source: str,
                        overrides: dict | str | None = None) -> tuple[tuple[str, Any], ...]:
    """The sampling defaults ``generation_config`` asks for: those the model's (or a folder's)
    generation_config.json sets to non-default values ("auto"), or none ("vllm"); then vLLM's
    ``override_generation_config`` (HF names) over them, whatever the source."""
    diff = dict(_generation_config_diff(model_path, source))
    extra = _json_object_or_text(overrides, "override_generation_config")
    unknown = sorted(set(extra) - set(_GENERATION_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config has unsupported key(s) {unknown}; allowed: "
                         f"{sorted(_GENERATION_FIELDS)}")
    diff.update(extra)
    return tuple((ours, diff[hf]) for hf, ours in _GENERATION_FIELDS.items() if diff.get(hf) is not None)


def _generation_config_diff(model_path: str, source: str) -> dict:
    if source == "vllm":
        return {}
    from transformers import GenerationConfig
    folder = model_path if source == "auto" else source
    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except OSError:
        if source == "auto":
            return {}  # the model has no generation_config.json: nothing to apply
        raise ValueError(f"generation_config={source!r} must be 'auto', 'vllm' or a folder holding a "
                         "generation_config.json") from None


def add_engine_args(parser: argparse.ArgumentParser, names: Sequence[str] | None = None,
                    title: str = "engine") -> None:
    """Adds one flag per EngineArgs field (vLLM's names) to ``parser``, from the fields' CliOption.

    ``names`` picks a subset of fields (a benchmark exposing a few engine options); default: all,
    with vLLM's other engine flags in a "vLLM compatibility" group.
    """
    chosen = [f for f in fields(EngineArgs) if not cli_option(f).python_only]
    if names is not None:
        unknown = set(names) - {f.name for f in chosen}
        if unknown:
            raise ValueError(f"names={sorted(unknown)} are not EngineArgs fields with a flag")
        chosen = [f for f in chosen if f.name in names]
    group = parser.add_argument_group(title)
    compat = parser.add_argument_group(
        f"vLLM compatibility (vLLM {vllm_version()}'s other engine flags: accepted at the values listed, which "
        "change nothing here; any other value is refused with the reason)") if names is None else None
    for f in chosen:
        opt = cli_option(f)
        target = compat if "vllm" in f.metadata else group
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        target.add_argument(*_flag_names(f.name, opt), dest=f.name, default=default, **_argparse_kwargs(f, opt))


def _flag_names(name: str, opt: CliOption) -> list[str]:
    return ["--" + name.replace("_", "-"), *opt.aliases]


def _argparse_kwargs(f: Field, opt: CliOption) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": argparse.SUPPRESS if opt.hidden else opt.help}
    if isinstance(f.default, bool) or opt.parse is bool:  # a switch: --flag / --no-flag, as vLLM's
        kwargs["action"] = argparse.BooleanOptionalAction
        return kwargs
    extra = {"choices": opt.choices, "type": opt.parse, "nargs": opt.nargs, "const": opt.const}
    return kwargs | {key: value for key, value in extra.items() if value is not None}


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """Same as :meth:`EngineArgs.from_cli_args` (the name the entry points import)."""
    return EngineArgs.from_cli_args(args)
