"""A stand-in for the ``vllm`` package, for testing benchmarks/vllm_runner.py and the
``--compare-vllm`` plumbing without vLLM: the same names the runner uses, deterministic
"greedy" outputs (each token is the previous one + 1), and, like vLLM's engine core, a
background process that outlives the runner (its pid and the engine's settings are written to
``$FAKE_VLLM_RECORD``). ``FAKE_VLLM_FAIL=1`` makes loading fail. With ``$FAKE_VLLM_CALLS`` set,
each ``reset_prefix_cache`` and ``generate`` call appends a line to that file (``reset``,
``generate <first prompt's first id> <requests>``). Like vLLM (its Triton notice), importing it
prints a line to stdout, which the JSON-line worker must keep out of its answers."""
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
        core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the lingering engine core
        record = dict(kwargs=kwargs, core_pid=core.pid, pgid=os.getpgid(0),
                      env={k: v for k, v in os.environ.items() if k.startswith("VLLM_")})
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump(record, f)

    def reset_prefix_cache(self) -> None:
        self.resets += 1
        _log_call("reset")

    def generate(self, prompts: list[dict], params: list[SamplingParams], use_tqdm: bool = True) -> list[_Output]:
        assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
        _log_call(f"generate {prompts[0]['prompt_token_ids'][0]} {len(prompts)}")
        return [_Output([_Completion(self._count_up(pr["prompt_token_ids"][-1], sp.max_tokens))])
                for pr, sp in zip(prompts, params)]

    def _count_up(self, last: int, n: int) -> list[int]:
        return [(last + i + 1) % self.vocab for i in range(n)]


def _log_call(line: str) -> None:
    if os.environ.get("FAKE_VLLM_CALLS"):
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:
            f.write(line + "\n")
