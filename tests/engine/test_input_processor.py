"""InputProcessor: bounded work on huge prompts, lone surrogates, id checks before the scan."""
from __future__ import annotations

import time

import pytest

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.sampling_params import SamplingParams


class CountingTokenizer:
    """One token per character except 'x', which its 'normalizer' deletes; records the work."""

    def __init__(self):
        self.encoded_chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return [ord(c) % 100 for c in text if c != "x"]

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bc": 1}  # longest entry: 2 characters


def _fits(num_prompt: int, max_tokens: int, num_seqs: int) -> None:
    if num_prompt + max_tokens > 64:
        raise ValueError("does not fit")


@pytest.fixture
def proc():
    return InputProcessor(CountingTokenizer(), vocab_size=100, max_model_len=64, check_fits=_fits)


def test_huge_prompt_is_refused_after_bounded_work(proc):
    text = "a" * 20_000_000
    with pytest.raises(ValueError, match="prompt of 20000000 characters is too long"):
        proc.process("r", text)
    assert proc.tokenizer.encoded_chars == 64 * 2  # max_model_len x longest token, not 20 MB


def test_long_text_that_a_normalizer_shrinks_is_still_accepted(proc):
    """The prefix check only refuses what cannot fit: when the tokenizer drops characters, the
    prefix is short in tokens and the whole text is tokenized and judged as usual."""
    out = proc.process("r", "x" * 1000 + "abc", SamplingParams(max_tokens=4))
    assert out.prompt_token_ids == [97, 98, 99] and out.params.max_tokens == 4


@pytest.mark.parametrize("prompt, position", [("\ud800", 0), ("ab\udc00", 2)])
def test_lone_surrogate_names_the_field(proc, prompt, position):
    with pytest.raises(ValueError, match=f"prompt contains a lone surrogate .* at character {position}"):
        proc.process("r", prompt)
    with pytest.raises(ValueError, match="^messages contains a lone surrogate"):
        proc.encode(prompt, field="messages")


def test_token_ids_checked_length_first_and_params_copied(proc):
    with pytest.raises(ValueError, match="prompt of 1000000 tokens is too long"):
        proc.process("r", {"prompt_token_ids": [-1] * 1_000_000})
    with pytest.raises(ValueError, match=r"prompt_token_ids contains \[100\]"):
        proc.process("r", [1, 100])
    params = SamplingParams(max_tokens=None)  # None: up to max_model_len
    out = proc.process("r", [1, 2, 3], params)
    assert out.params.max_tokens == 61 and params.max_tokens is None
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        proc.process("r", [1], {"max_tokens": 3})


def test_arrival_is_taken_before_the_processing(proc, monkeypatch):
    """TTFT and queue time start when the request arrives, not after its (image) processing."""
    slow = proc.tokenize_multimodal

    def tokenize_slowly(prompt):
        time.sleep(0.6)  # an HF image processor's share (long: the bound below keeps headroom on a loaded machine)
        return slow(prompt)

    monkeypatch.setattr(proc, "tokenize_multimodal", tokenize_slowly)
    before = time.time()
    out = proc.process("r", "abc")
    assert before <= out.arrival_time < before + 0.6
    assert proc.process("r", "abc", arrival_time=5.0).arrival_time == 5.0  # a caller's own stays
