"""``pagedllm generate --kv-trace FILE`` and ``pagedllm replay FILE``: the recording replays onto its
snapshot to the engine's final state, and the replay server serves the page and the recording."""
from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.entrypoints import cli
from pagedllm.entrypoints.dashboard.trace import _replay, build_replay_app, final_state, load_trace


@pytest.fixture(scope="module")
def trace(llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    code = cli.main(["generate", "--model", llama_dir, "--block-size", "8", "--num-gpu-blocks-override", "48",
                     "--max-model-len", "128", "--max-tokens", "12", "--temperature", "0", "--n", "2",
                     "--kv-trace", str(path), "a shared prefix, then one", "a shared prefix, then two"])
    assert code == 0
    return path


def test_the_trace_replays_to_the_engines_final_state(trace):
    lines = load_trace(trace)
    assert [line["event"] for line in lines[:2]] == ["snapshot", "metrics"] and lines[-1]["event"] == "metrics"
    first = lines[0]["data"]
    assert first["num_blocks"] == 48 and first["config"]["num_gpu_blocks"] == 48 and sum(first["ref_cnt"]) == 0
    steps = [ev for line in lines if line["event"] == "steps" for ev in line["data"]]
    assert [ev["step"] for ev in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 12
    assert any(ref >= 2 for ev in steps for _, ref, _ in ev["blocks"])  # n=2: the forks share their prompt
    end = final_state(lines)
    assert end["tables"] == {} and sum(end["ref_cnt"]) == 0 and end["hashes"]  # all done: cached-free blocks
    generated = {s[0]: s[2] for s in lines[-1]["data"]["samples"]}["generation_tokens_total"]
    assert generated == 2 * 2 * 12


def test_replay_serves_the_page_the_end_state_and_the_recording(trace):
    from starlette.testclient import TestClient
    client = TestClient(build_replay_app(trace, speed=100.0))
    assert "class Panel" in client.get("/dashboard").text
    assert client.get("/v1/kv_snapshot").json()["tables"] == {}

    async def first(n: int) -> list[tuple[str, dict]]:
        out, events = [], _replay(load_trace(trace), 1000.0)
        async for chunk in events:
            name, data = chunk.split("\n")[:2]
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
            if len(out) == n:
                await events.aclose()
                return out
    got = asyncio.run(first(3))
    assert [name for name, _ in got] == ["snapshot", "metrics", "steps"] and got[2][1][0]["step"] == 1


def test_a_file_that_is_not_a_trace_is_refused_by_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "event": "snapshot", "data": {}}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2 is not a --kv-trace line"):
        load_trace(bad)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"t": 0, "event": "snapshot", "data": {}}\n')
    with pytest.raises(ValueError, match="speed=0"):
        build_replay_app(ok, speed=0)
