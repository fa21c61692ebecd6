"""A server started with ``--scheduling-policy priority``, ``--enable-prompt-tokens-details`` and
``--return-tokens-as-token-ids``: request priorities order the queue, usage counts cached prompt
tokens, logprobs tokens show as ids unless a request says otherwise."""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from live_server import raw_http, server_model_dir, start_server  # noqa: F401 - fixture

from pagedllm.entrypoints.openai.api_server import make_arg_parser
from pagedllm.entrypoints.openai.serving import ResponseOptions


@pytest.fixture(scope="module")
def srv(server_model_dir):  # noqa: F811
    server = start_server(server_model_dir, response_options=ResponseOptions(True, True),
                          scheduling_policy="priority", max_num_seqs=1)
    yield server
    server.stop()


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")


def _waiting(srv) -> int:
    return len(srv.engine.engine.scheduler.waiting)


def test_priority_picks_the_next_request(srv, client):
    """One seat: a streamed request holds it while "later" (priority 5) then "sooner" (priority 1)
    queue; when it goes, "sooner" runs first although it came second."""
    holder = client.completions.create(model="tiny", prompt="hold", max_tokens=120, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(holder))  # running now: the only seat is taken
    finished: list[str] = []

    def send(name: str, priority: int) -> None:
        client.completions.create(model="tiny", prompt=name, max_tokens=16, temperature=0,
                                  extra_body={"priority": priority, "ignore_eos": True})
        finished.append(name)

    threads = [threading.Thread(target=send, args=("later", 5)), threading.Thread(target=send, args=("sooner", 1))]
    for t in threads:
        t.start()
        deadline = time.time() + 10
        while _waiting(srv) < threads.index(t) + 1 and time.time() < deadline:
            time.sleep(0.005)
    assert _waiting(srv) == 2, "both requests must be queued behind the holder"
    holder.close()  # the client goes: the holder is aborted and its seat freed
    # Read the order off the scheduler, not off the clients' replies: the thread that gets its
    # reply first is up to the OS on a loaded machine. While the seat's new owner runs its 16
    # steps, the one left waiting must be "later".
    deadline = time.time() + 30
    while _waiting(srv) == 2 and time.time() < deadline:
        time.sleep(0.001)
    left = [r.priority for r in srv.engine.engine.scheduler.waiting]
    for t in threads:
        t.join(30)
    assert left == [5], "'sooner' (priority 1) must take the seat first"
    assert sorted(finished) == ["later", "sooner"]
    assert srv.wait_idle().num_used_blocks == 0


def test_prompt_tokens_details_count_cached_tokens(srv, client):
    prompt = " ".join(["cached words"] * 4)  # ~45 tokens
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 8 == 0  # whole blocks of 8
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens == 0


def test_tokens_as_ids_by_default_and_the_request_overrides(srv):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    choice = httpx.post(f"{srv.url}/v1/completions", json=body).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    body["return_tokens_as_token_ids"] = False
    choice = httpx.post(f"{srv.url}/v1/completions", json=body).json()["choices"][0]
    tokenizer = srv.engine.engine.tokenizer
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in choice["token_ids"]]


def test_cli_flags():
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        ["--model", "m", "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
         "--scheduling-policy", "priority"])
    assert args.enable_prompt_tokens_details and args.return_tokens_as_token_ids
    assert args.scheduling_policy == "priority"
    defaults = make_arg_parser(argparse.ArgumentParser()).parse_args(["--model", "m"])
    assert not defaults.enable_prompt_tokens_details and defaults.scheduling_policy == "fcfs"


def test_a_beam_search_whose_client_leaves_is_aborted(srv, monkeypatch):
    """Its only chunk comes when the search ends; a client that leaves while it runs is gone, and
    the search is aborted (counted as an abort, not finished) with every block freed."""
    engine = srv.engine.engine
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.01), real_step())[1])  # >= 1 s for 110 tokens
    aborts = engine.counters.request_success["abort"]
    body = json.dumps({"model": "tiny", "prompt": "beams", "max_tokens": 110, "use_beam_search": True,
                       "ignore_eos": True, "stream": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    exchange = raw_http(srv.url, head, [body])
    deadline = time.time() + 10
    while not srv.engine._beams and time.time() < deadline:
        time.sleep(0.002)
    assert srv.engine._beams, "the beam search must be running"
    exchange.sock.shutdown(socket.SHUT_RDWR)  # the client leaves
    exchange.sock.close()
    stats = srv.wait_idle()
    assert engine.counters.request_success["abort"] == aborts + 1
    assert stats.num_used_blocks == 0 and not srv.engine._beams and not engine.has_unfinished_requests()
