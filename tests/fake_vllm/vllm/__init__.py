"""A stand-in for the ``vllm`` package, for testing benchmarks/vllm_runner.py and the
``--compare-vllm`` plumbing without vLLM: the same names the runner uses, deterministic
"greedy" outputs (each token is the previous one + 1), and, like vLLM's engine core, a
background process that outlives the runner (its pid and the engine's settings are written to
``$FAKE_VLLM_RECORD``). ``FAKE_VLLM_FAIL=1`` makes loading fail. With ``$FAKE_VLLM_CALLS`` set,
each load, ``reset_prefix_cache`` and ``generate`` call appends a line to that file (``load``
and the engine's keywords as JSON; ``reset``; ``generate <first prompt's first id> <requests>``,
then `` loras=`` and each request's adapter directory name, ``-`` for none, when adapters were
passed). As in vLLM, a request with an adapter (``vllm.lora.request.LoRARequest``) is refused
unless the engine was loaded with ``enable_lora``, an adapter id keeps its path, and the path
must hold a PEFT adapter; an adapter shifts its requests' outputs by its id. Like vLLM (its
Triton notice), importing it prints a line to stdout, which the JSON-line worker must keep out
of its answers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

__version__ = "0.0-fake"
print("Triton is installed, but doesn't include CPU backend. Disabling Triton.")  # as vLLM 0.32 does


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False


def TokensPrompt(prompt_token_ids: list[int]) -> dict:  # noqa: N802  (vLLM's name: a TypedDict)
    return {"prompt_token_ids": prompt_token_ids}


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    outputs: list[_Completion] = field(default_factory=list)


class LLM:
    def __init__(self, model: str, **kwargs):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("fake vLLM: failing to load as asked")
        with open(os.path.join(model, "config.json")) as f:
            self.vocab = json.load(f)["vocab_size"]
        self.resets = 0
        self.enable_lora = kwargs.get("enable_lora", False)
        self.lora_paths: dict[int, str] = {}
        _log_call("load " + json.dumps(kwargs, sort_keys=True))
        core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the lingering engine core
        record = dict(kwargs=kwargs, core_pid=core.pid, pgid=os.getpgid(0),
                      env={k: v for k, v in os.environ.items() if k.startswith("VLLM_")})
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump(record, f)

    def reset_prefix_cache(self) -> None:
        self.resets += 1
        _log_call("reset")

    def generate(self, prompts: list[dict], params: list[SamplingParams], use_tqdm: bool = True,
                 lora_request=None) -> list[_Output]:
        assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
        loras = [None] * len(prompts) if lora_request is None else list(lora_request)
        assert len(loras) == len(prompts)
        line = f"generate {prompts[0]['prompt_token_ids'][0]} {len(prompts)}"
        if lora_request is not None:
            line += " loras=" + ",".join("-" if lo is None else os.path.basename(lo.lora_path) for lo in loras)
        _log_call(line)
        for lo in loras:
            if lo is not None:
                self._check_lora(lo)
        return [_Output([_Completion(self._count_up(pr["prompt_token_ids"][-1] + (lo.lora_int_id if lo else 0),
                                                    sp.max_tokens))])
                for pr, sp, lo in zip(prompts, params, loras)]

    def _check_lora(self, lora) -> None:
        if not self.enable_lora:
            raise ValueError(f"LoRA request {lora.lora_name!r} for a model not loaded with enable_lora")
        if self.lora_paths.setdefault(lora.lora_int_id, lora.lora_path) != lora.lora_path:
            raise ValueError(f"adapter id {lora.lora_int_id} given two paths")
        if not os.path.isfile(os.path.join(lora.lora_path, "adapter_config.json")):
            raise ValueError(f"no PEFT adapter at {lora.lora_path}")

    def _count_up(self, last: int, n: int) -> list[int]:
        return [(last + i + 1) % self.vocab for i in range(n)]


def _log_call(line: str) -> None:
    if os.environ.get("FAKE_VLLM_CALLS"):
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:
            f.write(line + "\n")
