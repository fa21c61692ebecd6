"""vLLM's engine argument names (pagedllm/engine/vllm_engine_args.json, from vLLM 0.32.0's wheel):
every one is accepted at vLLM's default, in one EngineArgs and one LLM that generates; a value that
asks for a feature pagedllm lacks is a ValueError naming the argument; the honoured ones do what
vLLM's do; an unknown name is a TypeError naming the closest; ``vllm serve``'s engine flags parse."""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs, generation_defaults
from pagedllm.engine.vllm_args import STATUSES, load_table, vllm_args
from pagedllm.entrypoints.cli import build_parser
from pagedllm.models import loader
from tests.conftest import check_greedy_against

TABLE = load_table()["args"]
# the keywords issue 31 found raising TypeError
REPORTED = ("enable_chunked_prefill enable_lora data_parallel_size revision cpu_offload_gb compilation_config "
            "hf_overrides override_generation_config logits_processors enable_sleep_mode distributed_executor_backend "
            "load_format download_dir tokenizer_revision skip_tokenizer_init enable_expert_parallel async_scheduling "
            "structured_outputs_config limit_mm_per_prompt max_lora_rank task").split()
# a value no noop name accepts, by vLLM's value type
UNSUPPORTED = {"int": 12345, "float": 0.123, "str": "x-unsupported", "json": {"x-unsupported": 1},
               "list": ["x-unsupported"], "list_int": [12345], "bool_or_str": "x-unsupported"}


def vllm_defaults(llm: bool = False) -> dict:
    """Every EngineArgs name (or, with ``llm``, every LLM keyword too) at vLLM's default (LLM's where it differs)."""
    out = {}
    for name, entry in TABLE.items():
        if name == "model" or (entry["in"] == ["LLM"] and not llm):
            continue
        out[name] = entry.get("llm_default", entry["default"]) if llm else entry["default"]
    return out


def _refused_value(arg):
    if arg.type == "bool":
        return next((v for v in (True, False) if not arg.accepts(v)), None)
    return UNSUPPORTED[arg.type]


def test_table_records_vllm_032_and_decides_every_name():
    table = load_table()
    assert table["vllm_version"] == "0.32.0"
    assert {e["status"] for e in TABLE.values()} <= set(STATUSES)
    assert len(TABLE) > 250 and set(REPORTED) <= set(TABLE)
    declared = {f.name for f in fields(EngineArgs) if "vllm" not in f.metadata}
    generated = {f.name for f in fields(EngineArgs) if "vllm" in f.metadata}
    for name, arg in vllm_args().items():
        if arg.llm_only:
            assert name not in declared | generated, name
        elif arg.status == "honoured":
            assert name in declared, f"{name} is honoured, so EngineArgs declares it"
        else:
            assert name in generated and arg.reason, name


def test_every_name_at_vllms_default_in_one_engine_config(llama_dir):
    config = EngineArgs(model=llama_dir, **vllm_defaults()).create_engine_config()
    assert (config.scheduler.max_num_seqs, config.cache.block_size, config.cache.enable_prefix_caching) == \
        (256, 16, True)  # vLLM's None for ours
    assert config.pooler is None and config.speculative is None  # runner "auto" on a causal LM: generate


@pytest.fixture(scope="module")
def defaults_llm(llama_dir):
    from pagedllm import LLM
    with LLM(llama_dir, **{**vllm_defaults(llm=True), "num_gpu_blocks_override": 64}) as llm:
        yield llm


def test_llm_with_every_keyword_at_vllms_default_generates(defaults_llm, hf_models):
    check_greedy_against(defaults_llm, hf_models["llama"], [[5, 6, 7, 8], [9, 10, 11]], max_new=6)


@pytest.mark.parametrize("name", sorted(n for n, a in vllm_args().items()
                                        if a.status != "honoured" and not a.field and _refused_value(a) is not None))
def test_a_value_for_a_missing_feature_is_refused_naming_it(llama_dir, name):
    arg = vllm_args()[name]
    value = _refused_value(arg)
    with pytest.raises(ValueError, match=f"^{name}=") as e:
        EngineArgs(model=llama_dir, **{name: value}).create_engine_config()
    assert arg.reason in str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"fully_sharded_loras": True}, "fully_sharded_loras=True is not supported: the shrink is not sharded"),
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False"),
    ({"load_format": "pt"}, "load_format='pt'"),
    ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend='external_launcher'"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "distributed_executor_backend='uni'"),
    ({"task": "transcription"}, "task='transcription'"),
    ({"convert": "classify"}, "convert='classify'"),
    ({"kv_cache_memory": "1GiB", "kv_cache_memory_bytes": 1 << 30}, "kv_cache_memory_bytes"),
    ({"kv_offloading_size": 1, "kv_offload_cpu_gb": 1}, "kv_offloading_size"),
    ({"spec_tokens": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "spec_method"),
    ({"override_generation_config": {"do_sample": True}}, "override_generation_config"),
])
def test_honoured_names_refuse_what_they_cannot_do(llama_dir, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        EngineArgs(model=llama_dir, **kwargs).create_engine_config()


def test_data_parallel_in_llm_points_at_serve(llama_dir):
    from pagedllm import LLM
    with pytest.raises(ValueError, match="data_parallel_size=2.*pagedllm serve MODEL --data-parallel-size"):
        LLM(llama_dir, data_parallel_size=2)


@pytest.mark.parametrize("make", [lambda kw: EngineArgs(**kw), lambda kw: __import__("pagedllm").LLM("m", **kw)])
def test_unknown_name_is_a_type_error_naming_the_closest(make):
    with pytest.raises(TypeError, match="'enable_prefix_cache'.*did you mean 'enable_prefix_caching'"):
        make({"enable_prefix_cache": True})
    with pytest.raises(TypeError, match="'zzz_not_an_arg'"):
        make({"zzz_not_an_arg": 1})


def test_task_and_convert_map_to_the_runner(llama_dir):
    with pytest.warns(DeprecationWarning, match="task='embed'"):
        assert EngineArgs(model=llama_dir, task="embed").create_engine_config().pooler is not None
    with pytest.warns(DeprecationWarning):
        assert EngineArgs(model=llama_dir, task="generate").create_engine_config().pooler is None
    assert EngineArgs(model=llama_dir, convert="embed").create_engine_config().pooler is not None
    assert EngineArgs(model=llama_dir, runner="auto").create_engine_config().pooler is None


def test_vllm_spellings_of_our_options(llama_dir):
    config = EngineArgs(model=llama_dir, spec_method="ngram", spec_tokens=3, kv_cache_memory_bytes=1 << 24,
                        kv_offloading_size=2, tokenizer_mode="hf").create_engine_config()
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert config.cache.kv_cache_memory == 1 << 24 and config.cache.kv_offload_cpu_bytes == 2 << 30
    assert config.model.tokenizer_mode == "auto"


def test_hf_overrides_dict_json_and_callable(llama_dir):
    def hf(overrides):
        return EngineArgs(model=llama_dir, hf_overrides=overrides).create_engine_config().model.hf_config
    assert hf({"rms_norm_eps": 1e-3}).rms_norm_eps == 1e-3
    assert hf('{"rms_norm_eps": 0.002}').rms_norm_eps == 0.002

    def double_eps(config):
        config.rms_norm_eps *= 2
        return config
    assert hf(double_eps).rms_norm_eps == 2 * hf(None).rms_norm_eps


def test_hf_config_path_and_vllm_add_cli_args(model_dirs):
    config = EngineArgs(model=model_dirs["llama"], hf_config_path=model_dirs["qwen2"]).create_engine_config()
    assert config.model.architecture == "Qwen2ForCausalLM"
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--enable-lora", "--seed", "3"])) == \
        EngineArgs(enable_lora=True, seed=3)


def test_hub_options_reach_the_download(monkeypatch, llama_dir):
    """revision / download_dir / hf_token go to huggingface_hub; tokenizer_revision fetches the tokenizer."""
    import huggingface_hub
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["revision"], kwargs["cache_dir"], kwargs["token"]))
        return llama_dir
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    EngineArgs(model="org/tiny", revision="v1", tokenizer_revision="v2", download_dir="/tmp/dl",
               hf_token="hf_x").create_engine_config()
    assert calls == [("org/tiny", "v1", "/tmp/dl", "hf_x"), ("org/tiny", "v2", "/tmp/dl", "hf_x")]


def test_override_generation_config_is_merged_over_the_models(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 7}')
    merged = dict(generation_defaults(str(tmp_path), "auto", {"temperature": 0.2, "max_new_tokens": 5}))
    assert merged == {"temperature": 0.2, "top_k": 7, "max_tokens": 5}
    assert dict(generation_defaults(str(tmp_path), "vllm", '{"top_p": 0.5}')) == {"top_p": 0.5}


def test_dummy_weights_are_small_seeded_and_ones_for_norms():
    import torch
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(8, 8), "input_layernorm": torch.nn.LayerNorm(8)})
    loader.fill_dummy_weights(model, seed=3)
    weight = model["proj"].weight.detach().clone()
    assert weight.abs().max() <= 1e-3 and weight.std() > 0
    assert torch.equal(model["input_layernorm"].weight, torch.ones(8))
    loader.fill_dummy_weights(model, seed=3)
    assert torch.equal(model["proj"].weight, weight)


def test_dummy_load_format_and_chat_template_in_llm(llama_dir, defaults_llm):
    from pagedllm import LLM, SamplingParams
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(llama_dir, load_format="dummy", chat_template=template, num_gpu_blocks_override=32) as llm:
        out = llm.chat([{"role": "user", "content": "hello world"}], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == llm.get_tokenizer()("hello world")["input_ids"]
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        dummy = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    real = defaults_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert dummy != real  # random weights, not the checkpoint's


# a production `vllm serve` command line's engine flags (vLLM's spellings, --no- forms, JSON values)
VLLM_SERVE = ("--dtype auto --max-model-len 256 --gpu-memory-utilization 0.5 --max-num-seqs 8 "
              "--max-num-batched-tokens 512 --enable-chunked-prefill --no-enable-prefix-caching --block-size 16 "
              "--kv-cache-dtype auto -tp 1 --distributed-executor-backend mp --trust-remote-code --revision main "
              "--load-format safetensors --hf-overrides '{\"rms_norm_eps\": 0.001}' --task generate --seed 0 "
              "--enforce-eager --disable-log-stats --no-enable-lora --max-lora-rank 16 --max-loras 1 "
              "--limit-mm-per-prompt '{}' --no-async-scheduling --compilation-config '{}' --swap-space 1 "
              "--served-model-name tiny --generation-config auto --override-generation-config "
              "'{\"temperature\": 0.5}' --enable-sleep-mode --kv-cache-memory-bytes 16777216 "
              "--device-memory-utilization 0.5 --tokenizer-mode hf --runner auto --convert auto "
              "--max-logprobs 20 --scheduling-policy fcfs --enable-expert-parallel")


def test_vllm_serve_engine_flags_parse(llama_dir):
    argv = ["serve", llama_dir, *shlex.split(VLLM_SERVE)]
    args = EngineArgs.from_cli_args(build_parser().parse_args(argv))
    assert (args.enable_prefix_caching, args.enable_chunked_prefill, args.enable_lora, args.task,
            args.hf_overrides, args.enable_expert_parallel) == (False, True, False, "generate",
                                                                {"rms_norm_eps": 0.001}, True)
    with pytest.raises(ValueError, match="enable_expert_parallel=True"):
        args.create_engine_config()
    args.enable_expert_parallel = False
    with pytest.warns(DeprecationWarning):
        config = args.create_engine_config()
    assert config.model.hf_config.rms_norm_eps == 0.001 and config.model.enable_sleep_mode
    assert dict(config.model.generation_defaults)["temperature"] == 0.5
    assert (config.cache.kv_cache_memory, config.scheduler.max_num_seqs) == (16777216, 8)


def test_help_lists_the_vllm_compatibility_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = capsys.readouterr().out
    assert "vLLM compatibility" in text and "--enable-lora, --no-enable-lora" in text
    assert "--enable-moe-shared-loras" in text and "--hf-overrides" in text


def test_table_regenerates_from_the_wheel_sources(tmp_path):
    """scripts/vllm_engine_args.py keeps the decisions and marks a name new in the wheel unreviewed."""
    import importlib.util
    script = Path(__file__).resolve().parents[2] / "scripts" / "vllm_engine_args.py"
    spec = importlib.util.spec_from_file_location("regen", script)
    regen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen)
    arg_utils = ("from dataclasses import dataclass\nclass ModelConfig:\n    seed: int = 0\n"
                 "@dataclass\nclass EngineArgs:\n    seed: int = ModelConfig.seed\n    brand_new: bool = False\n"
                 "    @staticmethod\n    def add_cli_args(parser):\n"
                 "        parser.add_argument('--brand-new', '-bn', action='store_true')\n")
    llm = "class LLM:\n    def __init__(self, model: str, *, seed: int = 1, **kwargs):\n        pass\n"
    sources = {"vllm/engine/arg_utils.py": arg_utils, "vllm/entrypoints/llm.py": llm,
               "vllm/_version.py": "__version__ = version = '9.9.9'\n"}
    table = regen.build_table(sources, load_table())
    assert table["vllm_version"] == "9.9.9"
    assert table["args"]["brand_new"] | {} == {"annotation": "bool", "type": "bool", "default_source": "False",
                                                "default": False, "in": ["EngineArgs"],
                                                "flags": ["--brand-new", "-bn"], "status": "unreviewed"}
    assert table["args"]["seed"]["status"] == "honoured" and table["args"]["seed"]["llm_default"] == 1
    assert table["args"]["task"] == TABLE["task"]  # kept from older vLLM
    json.dumps(table)


def test_ray_backend_without_ray_is_refused_with_the_install_hint(llama_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ValueError, match=r"'ray' needs Ray: pip install 'pagedllm\[ray\]'"):
        EngineArgs(model=llama_dir, distributed_executor_backend="ray", tensor_parallel_size=2).create_engine_config()
