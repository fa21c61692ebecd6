"""AsyncLLMEngine on its own: output kinds, validation before streaming, abort on cancel/close."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from live_server import server_model_dir  # noqa: F401 - fixture

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine_args(server_model_dir):  # noqa: F811
    return EngineArgs(model=server_model_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)


def run(engine_args, body):
    """Runs ``body(engine)`` with a fresh AsyncLLMEngine, shut down afterwards."""
    async def main():
        engine = AsyncLLMEngine.from_engine_args(engine_args)
        try:
            return await body(engine)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


async def texts(engine, kind: str, rid: str, prompt: str = "héllo wörld") -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=12, output_kind=kind, ignore_eos=True)
    return [out.outputs[0].text async for out in engine.generate(prompt, params, rid)]


def test_output_kinds_agree_and_deltas_join_to_the_text(engine_args):
    async def body(engine):
        return await asyncio.gather(texts(engine, "delta", "d"), texts(engine, "cumulative", "c"),
                                    texts(engine, "final_only", "f"))
    delta, cumulative, final = run(engine_args, body)
    assert len(final) == 1 and "".join(delta) == cumulative[-1] == final[0]
    assert all(b.startswith(a) for a, b in zip(cumulative, cumulative[1:]))


def test_validation_error_before_streaming_and_duplicate_ids(engine_args):
    async def body(engine):
        with pytest.raises(ValueError, match="max_model_len"):
            await anext(engine.generate({"prompt_token_ids": [5] * 200}, SamplingParams(), "bad"))
        gen = engine.generate("hi", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await anext(gen)
        with pytest.raises(ValueError, match="already in use"):
            await anext(engine.generate("hi", SamplingParams(), "dup"))
        await gen.aclose()
        return await engine.get_kv_cache_stats()
    assert run(engine_args, body).num_used_blocks == 0


def test_cancelled_and_closed_requests_free_their_blocks(engine_args):
    async def consume(engine, rid):
        async for _ in engine.generate("hello world", SamplingParams(max_tokens=100, ignore_eos=True), rid):
            pass

    async def body(engine):
        real_step = engine.engine.step

        def slow_step():  # keep the requests running (>= 1 s for 100 tokens) to cancel them mid-flight
            time.sleep(0.01)
            return real_step()

        engine.engine.step = slow_step
        tasks = [asyncio.create_task(consume(engine, f"r{i}")) for i in range(4)]
        deadline = time.monotonic() + 60  # generous: a loaded machine is slow to start them, not to run them
        while (await engine.get_kv_cache_stats()).num_used_blocks < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # until all four hold blocks
        assert (await engine.get_kv_cache_stats()).num_used_blocks >= 4
        assert not any(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # the cancelled generators queued their aborts on exit; engine ops run in order, so the
        # stats op below runs after them (no sleep needed)
        return await engine.get_kv_cache_stats(), engine.engine.counters.request_success["abort"]
    stats, aborted = run(engine_args, body)
    assert stats.num_used_blocks == 0 and aborted == 4


def test_dead_engine_fails_in_flight_and_new_requests(engine_args):
    async def body(engine):
        engine.engine.step = lambda: 1 / 0
        with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
            await texts(engine, "delta", "x")
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await texts(engine, "delta", "y")
    run(engine_args, body)


class Recorder:
    """An output observer that keeps everything leaving the engine."""

    def __init__(self):
        self.outputs = []

    def observe(self, out):
        self.outputs.append(out)


def test_final_only_leaves_the_engine_once_with_every_step_latency(engine_args):
    """A final-only (non-streaming) request yields one output from the engine, not one per
    step re-assembled later; that output still reports all 7 gaps between its 8 token steps."""
    async def body(engine):
        rec = Recorder()
        engine.observers.append(rec)
        outs = {}
        for kind in ("final_only", "delta"):
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind)
            outs[kind] = [o async for o in engine.generate("héllo", params, kind)]
        return outs, rec.outputs
    outs, seen = run(engine_args, body)
    final = [o for o in seen if o.request_id == "final_only"]
    assert len(final) == len(outs["final_only"]) == 1 and final[0].finished
    assert final[0].metrics.is_first_output and len(final[0].metrics.inter_token_latencies) == 7
    delta = [o for o in seen if o.request_id == "delta"]
    assert len(delta) == 8 and [o.metrics.is_first_output for o in delta] == [True] + [False] * 7
    assert sum(len(o.metrics.inter_token_latencies) for o in delta) == 7
    assert "".join(o.outputs[0].text for o in outs["delta"]) == outs["final_only"][0].outputs[0].text


def test_huge_prompt_does_not_stall_a_small_request(engine_args):
    """A 20 MB prompt is refused (after bounded work, off the engine thread) while a 2-token
    request runs beside it: the small one is not held up."""
    async def body(engine):
        await texts(engine, "final_only", "warm-up")
        huge = asyncio.create_task(anext(engine.generate("hello world " * 1_750_000, SamplingParams(), "huge")))
        await asyncio.sleep(0)  # the huge request is submitted first
        t0 = time.perf_counter()
        small = [o async for o in engine.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True), "small")]
        elapsed = time.perf_counter() - t0
        with pytest.raises(ValueError, match="^prompt of 21000000 characters is too long"):
            await huge
        return elapsed, small
    elapsed, small = run(engine_args, body)
    assert small[-1].finished and len(small[-1].outputs[0].token_ids) == 2
    assert elapsed < 1.0


def test_tokenization_runs_off_the_engine_thread(engine_args, monkeypatch):
    """Even a prompt that is slow to tokenize delays only itself."""
    from pagedllm.engine.input_processor import InputProcessor
    real_encode, threads = InputProcessor.encode, []

    def slow_encode(self, text, **kw):
        threads.append(threading.current_thread().name)
        if text.startswith("SLOW"):
            time.sleep(2.0)
        return real_encode(self, text, **kw)
    monkeypatch.setattr(InputProcessor, "encode", slow_encode)

    async def body(engine):
        await texts(engine, "final_only", "warm-up")
        slow = asyncio.create_task(texts(engine, "final_only", "slow", prompt="SLOW hello"))
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        await texts(engine, "final_only", "fast")
        return time.perf_counter() - t0, await slow
    elapsed, slow_text = run(engine_args, body)
    assert elapsed < 1.0 and len(slow_text) == 1
    assert threads and all(name.startswith("pagedllm-tokenize") for name in threads)


def test_lone_surrogate_is_a_value_error_naming_the_prompt(engine_args):
    async def body(engine):
        with pytest.raises(ValueError, match="^prompt contains a lone surrogate U\\+D800 at character 2"):
            await anext(engine.generate("ab\ud800", SamplingParams(), "s"))
        return await engine.get_kv_cache_stats()
    assert run(engine_args, body).num_used_blocks == 0
