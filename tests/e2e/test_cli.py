"""The pagedllm CLI under subprocess: exit codes and the lines it prints."""
from __future__ import annotations

import subprocess
import sys

import pytest

# Even ``--help`` imports torch: 3 s of CPU, but 24-31 s of wall clock on the shared 2-core box at load
# ~12 and 49 s with a CPU hog per core beside it, so every run gets 180 s (was 60 s for help and bad flags).
CLI_TIMEOUT_S = 180


def _cli(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "pagedllm", *args], input=stdin, capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S)


def test_generate_prints_completions_and_summary(llama_dir):
    r = _cli("generate", "--model", llama_dir, "--max-tokens", "6", "--temperature", "0",
             "--num-gpu-blocks-override", "64", "hello world", "the lazy dog")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("--- ") == 2 and "'hello world'" in r.stdout
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("[pagedllm] 2 requests") and "12 generated tokens" in summary
    assert "KV blocks used at peak" in summary and "of 64" in summary and "prefix-cache hits" in summary


def test_chat_streams_and_exits(llama_dir):
    r = _cli("chat", "--model", llama_dir, "--max-tokens", "5", "--num-gpu-blocks-override", "64",
             stdin="hello world\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hello world")


@pytest.mark.parametrize("args, flag", [
    (["generate", "--block-size", "7", "x"], "--block-size"),
    (["generate", "--max-num-seqs", "many", "x"], "--max-num-seqs"),
    (["generate", "--preemption-mode", "drop", "x"], "--preemption-mode"),
    (["plan", "--model", "x", "--block-size", "7"], "--block-size"),
])
def test_bad_flags_exit_nonzero_naming_the_flag(args, flag):
    r = _cli(*args)
    assert r.returncode != 0 and flag in r.stderr


def test_bad_values_exit_nonzero_with_parameter_name(llama_dir):
    r = _cli("generate", "--model", llama_dir, "--top-p", "0", "--num-gpu-blocks-override", "64", "x")
    assert r.returncode == 2 and "top_p" in r.stderr


@pytest.mark.parametrize("sub", ["generate", "chat", "plan", "router"])
def test_help_has_examples(sub):
    r = _cli(sub, "--help")
    assert r.returncode == 0 and "examples" in r.stdout.lower()


def test_sampling_flags_fall_back_to_generation_config_then_cli_defaults(llama_dir, tmp_path):
    import argparse
    import shutil

    from pagedllm.entrypoints.cli import CLI_DEFAULTS, add_sampling_args, sampling_params_from_cli
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args(["--top-p", "0.5"])
    p = sampling_params_from_cli(args, {"temperature": 0.0, "top_p": 0.9, "max_tokens": 3})
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k) == (0.0, 0.5, 3, -1)  # flag > model > CLI
    plain = sampling_params_from_cli(args)
    assert (plain.temperature, plain.max_tokens) == (CLI_DEFAULTS["temperature"], CLI_DEFAULTS["max_tokens"])
    model = shutil.copytree(llama_dir, tmp_path / "model")
    (model / "generation_config.json").write_text('{"max_new_tokens": 3}')
    r = _cli("generate", "--model", str(model), "--ignore-eos", "--num-gpu-blocks-override", "64", "hello")
    assert r.returncode == 0 and "3 generated tokens" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("headless", [True, False])
def test_serve_builds_the_engine_config_once(llama_dir, monkeypatch, headless):
    """Deciding headless-or-not and starting the node (or the engine) share one EngineConfig."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints import headless as headless_entry
    from pagedllm.entrypoints.openai import api_server
    built, real = [], EngineArgs.create_engine_config
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: built.append(real(self)) or built[-1])
    started = []
    monkeypatch.setattr(headless_entry, "run_node", lambda config, *timeouts: started.append(config) or 0)
    monkeypatch.setattr(api_server, "serve_app", lambda app, *args: started.append(app.state.engine.engine.config))
    argv = ["--model", llama_dir, "--num-gpu-blocks-override", "16", "--max-model-len", "128"]
    if headless:
        argv += ["--headless", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                 "--master-addr", "127.0.0.1", "--master-port", "29511"]
    assert api_server.main(argv) == 0
    assert len(built) == 1 and started == built
