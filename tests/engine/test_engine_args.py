"""EngineArgs is the one declaration of engine options: it makes the flags of every command, the
flags map back to the same values, choices are the configs' constants, and no field is accepted and
then ignored (each one changes the EngineConfig it creates)."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from pagedllm.attention import selector
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
)
from pagedllm.engine.arg_utils import CONVERTS, EXECUTOR_BACKENDS, EngineArgs, add_engine_args, cli_option
from pagedllm.entrypoints.cli import build_parser
from pagedllm.layers import quantization
from pagedllm.layers.ops import FUSED_OPS
from pagedllm.models.loader import LOAD_FORMATS

CHOICES = {
    "tokenizer_mode": TOKENIZER_MODES, "dtype": DTYPES, "block_size": ALLOWED_BLOCK_SIZES,
    "preemption_mode": PREEMPTION_MODES, "quantization": quantization.METHODS,
    "kv_cache_dtype": tuple(KV_CACHE_DTYPES), "attention_backend": selector.BACKENDS,
    "preallocation": PREALLOCATION_MODES, "fused_ops": FUSED_OPS, "scheduling_policy": SCHEDULING_POLICIES,
    "runner": ("auto", *RUNNERS), "convert": CONVERTS, "load_format": LOAD_FORMATS,
    "kv_offloading_backend": ("native",), "lora_dtype": LORA_DTYPES, "distributed_executor_backend": EXECUTOR_BACKENDS,
    "kv_role": KV_ROLES,
}
CHOICES["tokenizer_mode"] = (*TOKENIZER_MODES, "hf")
# a value other than the default for every declared field (a new field must be added here, or to
# SEPARATELY_TESTED); vLLM's names pagedllm does not declare are tests/engine/test_vllm_engine_args.py's
NON_DEFAULT = {
    "model": "org/model", "tokenizer": "org/tok", "tokenizer_mode": "slow", "trust_remote_code": True,
    "dtype": "bfloat16", "block_size": 32, "gpu_memory_utilization": 0.5, "kv_cache_memory": "1GiB",
    "swap_space": "2GiB", "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 512,
    "enable_prefix_caching": False, "preemption_mode": "swap", "seed": 7, "enforce_eager": True,
    "compile_model": True, "quantization": "int8", "kv_cache_dtype": "float16", "tensor_parallel_size": 2,
    "num_gpu_blocks_override": 99, "attention_backend": "sdpa", "num_threads": 3, "device": "cuda",
    "watermark": 0.05, "disable_log_stats": False, "log_stats_interval": 2.5, "served_model_name": ["a", "b"],
    "preallocation": "request", "fused_ops": "triton", "max_logprobs": 5, "generation_config": "vllm",
    "pipeline_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 29500,
    "kv_offload_cpu_gb": 1.5, "kv_offload_dir": "/tmp/pagedllm-kv-tier-args", "kv_offload_disk_gb": 2.0,
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}', "calculate_kv_scales": True,
    "scheduling_policy": "priority", "runner": "pooling", "pooler_config": '{"normalize": false}',
    "max_structured_output_bytes": 1000, "structured_output_compile_timeout": 5.0,
    "kv_cache_memory_bytes": 1 << 30, "convert": "embed", "load_format": "dummy",
    "override_generation_config": {"temperature": 0.3}, "kv_offloading_size": 1.5, "enable_sleep_mode": True,
    "hf_config_path": "org/config", "limit_mm_per_prompt": {"image": 2}, "mm_processor_kwargs": {"do_resize": False},
    "allowed_local_media_path": "/tmp", "mm_processor_cache_gb": 1.5, "allowed_media_domains": ["example.com"],
    "enable_lora": True, "max_loras": 4, "max_lora_rank": 8, "max_cpu_loras": 6, "lora_dtype": "float16",
    "kv_offload_remote": "redis://127.0.0.1:6379/0", "kv_offload_remote_ttl": 600, "kv_role": "producer",
    "kv_transfer_config": '{"kv_role": "kv_producer"}',  # vLLM's JSON text, as the CLI keeps it
    "disable_chunked_mm_input": True, "language_model_only": True, "skip_mm_profiling": True,
}
# declared fields whose effect is outside the EngineConfig (tested in test_vllm_engine_args.py):
# Hub download options, config overrides (hf_config is not compared), the spec_* shorthand, and
# values with no non-default we honour (chunked prefill is always on, offloading is native)
SEPARATELY_TESTED = {
    "revision": "main", "tokenizer_revision": "main", "download_dir": "/tmp/hf-downloads", "hf_token": "hf_x",
    "hf_overrides": {"rms_norm_eps": 1e-3}, "spec_method": "ngram", "spec_model": "org/draft", "spec_tokens": 3,
    "enable_chunked_prefill": True, "kv_offloading_backend": "native",
    "distributed_executor_backend": "ray",  # needs Ray: tests/distributed/test_ray_executor.py
}
# a field whose effect shows only when another one is set
NEEDS = {"enforce_eager": {"compile_model": True}, "log_stats_interval": {"disable_log_stats": False},
         "nnodes": {"tensor_parallel_size": 2, "master_port": 29500},
         "node_rank": {"tensor_parallel_size": 2, "nnodes": 2, "master_port": 29500},
         "kv_offload_disk_gb": {"kv_offload_dir": "/tmp/pagedllm-kv-tier-args"},
         **{name: {"kv_offload_remote": "redis://127.0.0.1:6379/0"}
            for name in ("kv_offload_remote_ttl", "kv_role", "kv_transfer_config")},
         "calculate_kv_scales": {"kv_cache_dtype": "fp8"}, "pooler_config": {"runner": "pooling"},
         **{name: {"enable_lora": True} for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype")}}


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def _argv(values: dict) -> list[str]:
    argv = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, *map(str, value if isinstance(value, list) else [value])]
    return argv


def test_every_field_has_a_flag_or_a_reason_to_be_python_only():
    dests = {a.dest for a in _engine_parser()._actions} - {"help"}
    for f in fields(EngineArgs):
        reason = cli_option(f).python_only
        assert (f.name in dests) != bool(reason), f.name
    declared = {f.name for f in fields(EngineArgs) if "vllm" not in f.metadata}
    assert set(NON_DEFAULT) | set(SEPARATELY_TESTED) == declared


def test_choices_are_the_config_constants():
    actions = {a.dest: a for a in _engine_parser()._actions}
    assert {name: tuple(a.choices) for name, a in actions.items() if a.choices} == CHOICES


def test_defaults_parse_to_the_dataclass_defaults():
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()


@pytest.mark.parametrize("command", [["generate", "a prompt"], ["chat"], ["serve"]])
def test_cli_round_trip_on_every_command(command):
    values = {**NON_DEFAULT, **SEPARATELY_TESTED}
    argv = [command[0], *_argv(values), *command[1:]]
    assert EngineArgs.from_cli_args(build_parser().parse_args(argv)) == EngineArgs(**values)


def test_existing_flag_spellings_still_parse():
    args = _engine_parser().parse_args(["-q", "int8", "-tp", "2", "--enable-prefix-caching", "--compile-model"])
    assert (args.quantization, args.tensor_parallel_size, args.enable_prefix_caching, args.compile_model) == \
        ("int8", 2, True, True)


def test_hidden_flag_is_accepted_but_not_listed():
    parser = _engine_parser()
    assert parser.parse_args(["--preallocation", "max_model_len"]).preallocation == "max_model_len"
    assert "--preallocation" not in parser.format_help()


def test_bad_choice_exits_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _engine_parser().parse_args(["--tokenizer-mode", "fast"])
    assert "--tokenizer-mode" in capsys.readouterr().err


@pytest.fixture(scope="module")
def config_values(model_dirs):
    return {**NON_DEFAULT, "model": model_dirs["mistral"], "tokenizer": model_dirs["qwen2"],
            "hf_config_path": model_dirs["qwen2"]}


@pytest.fixture(scope="module")
def sampling_defaults_dir(tmp_path_factory):
    """A generation_config.json with sampling defaults (the tiny models' set none)."""
    path = tmp_path_factory.mktemp("generation_config")
    (path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 7, "max_new_tokens": 9}')
    return str(path)


@pytest.mark.parametrize("name", list(NON_DEFAULT))
def test_every_field_changes_the_engine_config(llama_dir, config_values, sampling_defaults_dir, name):
    base = {"model": llama_dir, **NEEDS.get(name, {})}
    if name == "generation_config":  # "vllm" drops defaults only where there are some
        base["generation_config"] = sampling_defaults_dir
    before = EngineArgs(**base).create_engine_config()
    after = EngineArgs(**{**base, name: config_values[name]}).create_engine_config()
    assert after != before, name


@pytest.mark.parametrize("kwargs, word", [
    ({"tokenizer_mode": "fast"}, "tokenizer_mode"),
    ({"disable_log_stats": False, "log_stats_interval": 0}, "log_stats_interval"),
    ({"kv_offload_cpu_gb": -1}, "kv_offload_cpu_gb"),
    ({"kv_offload_cpu_gb": float("nan")}, "kv_offload_cpu_gb"),
    ({"swap_space": float("inf")}, "swap_space"),
    ({"kv_offload_disk_gb": 1}, "kv_offload_disk_gb"),
    ({"kv_offload_dir": "/tmp/x", "kv_offload_disk_gb": 0}, "kv_offload_disk_gb"),
    ({"kv_offload_cpu_gb": 1, "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_offload_cpu_gb": 1, "pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"kv_offload_remote": "redis://h:1/0", "pipeline_parallel_size": 2}, "kv_offload_remote='redis://h:1/0'"),
    ({"kv_offload_remote": "memcached://h:1"}, "kv_offload_remote='memcached://h:1'"),
    ({"kv_offload_remote_ttl": 60}, "kv_offload_remote_ttl_s=60"),
    ({"kv_cache_dtype": "fp8", "calculate_kv_scales": True, "kv_offload_dir": "/tmp/x"}, "calculate_kv_scales"),
])
def test_bad_values_are_refused_naming_the_parameter(llama_dir, kwargs, word):
    with pytest.raises(ValueError, match=word):
        EngineArgs(model=llama_dir, **kwargs).create_engine_config()


def test_served_model_names(llama_dir):
    assert EngineArgs(model=llama_dir).create_engine_config().model.served_model_names == (llama_dir,)
    assert EngineArgs(model=llama_dir, served_model_name="x").served_model_names() == ("x",)


def test_generation_config_defaults(llama_dir, sampling_defaults_dir):
    """generation_config.json's sampling values become the default SamplingParams; "vllm" ignores them."""
    from pagedllm.engine.arg_utils import generation_defaults
    assert dict(generation_defaults(sampling_defaults_dir, "auto")) == {"temperature": 0.6, "top_k": 7,
                                                                        "max_tokens": 9}
    assert generation_defaults(sampling_defaults_dir, "vllm") == ()
    assert generation_defaults(llama_dir, "auto") == ()  # only eos/bos/pad there
    with pytest.raises(ValueError, match="generation_config"):
        EngineArgs(model=llama_dir, generation_config=str(llama_dir) + "/missing").create_engine_config()
