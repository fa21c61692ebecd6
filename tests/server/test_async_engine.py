"""AsyncLLMEngine on its own: output kinds, validation before streaming, abort on cancel/close."""
from __future__ import annotations

import asyncio
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

        def slow_step():  # keep the requests running long enough to cancel them mid-flight
            time.sleep(0.005)
            return real_step()

        engine.engine.step = slow_step
        tasks = [asyncio.create_task(consume(engine, f"r{i}")) for i in range(4)]
        for _ in range(200):  # until all four hold blocks (at most ~2 s)
            await asyncio.sleep(0.01)
            if (await engine.get_kv_cache_stats()).num_used_blocks >= 4:
                break
        assert (await engine.get_kv_cache_stats()).num_used_blocks > 0
        assert not any(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.1)  # the aborts run before the engine's next step
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
