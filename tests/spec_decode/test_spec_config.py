"""speculative_config: vLLM's names parsed into a frozen SpeculativeConfig; bad ones refused
naming the field; the CLI takes it as JSON."""
from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM
from pagedllm.contracts.speculative_config import SpeculativeConfig, parse_speculative_config
from pagedllm.engine.arg_utils import EngineArgs, add_engine_args
from pagedllm.sampling_params import BeamSearchParams


def test_ngram_defaults_follow_vllm():
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert spec == SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4)
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2}).method == "ngram"
    assert parse_speculative_config({"model": "some/draft", "num_speculative_tokens": 2}).method == "draft_model"


@pytest.mark.parametrize("raw, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical"}, "acceptance_method"),
    ({"num_speculative_tokens": 2}, "method"),
    ("{not json", "speculative_config"),
    ("[1, 2]", "speculative_config"),
])
def test_bad_configs_are_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(raw)


def test_draft_with_another_vocabulary_is_refused(llama_dir, model_dirs, tmp_path):
    from conftest import make_model_dir
    other = make_model_dir(tmp_path / "vocab256", vocab_size=256)
    with pytest.raises(ValueError, match=r"speculative_config.model=.*vocab_size=256"):
        EngineArgs(model=llama_dir, speculative_config={"model": other, "num_speculative_tokens": 2}
                   ).create_engine_config()
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineArgs(model=llama_dir, speculative_config={"model": str(tmp_path / "missing"),
                                                         "num_speculative_tokens": 2}).create_engine_config()


def test_draft_resolves_with_the_targets_dtype_and_context(llama_dir, model_dirs):
    config = EngineArgs(model=llama_dir, max_model_len=128,
                        speculative_config={"model": model_dirs["qwen2"], "num_speculative_tokens": 2}
                        ).create_engine_config()
    assert config.speculative.draft.max_model_len == 128
    assert config.speculative.draft.dtype == config.model.dtype
    assert config.speculative.draft.architecture != config.model.architecture


def test_cli_flag_takes_json_and_refuses_bad_json(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", text])).speculative_config == text
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{method: ngram}"])
    assert "--speculative-config" in capsys.readouterr().err


def test_beam_search_is_refused_with_speculation(llama_dir):
    llm = LLM(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config"):
        llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=4))
