"""Grammar compiles are charged to the HTTP client, not to the request: one client's many big schemas
hold at most one compile slot ahead of another client's, and a cached spec never waits."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from live_server import server_model_dir, start_server  # noqa: F401 - fixtures

from pagedllm.entrypoints.openai.client_identity import _CONNECTION, client_id, connection_identity
from pagedllm.structured_output.compile_queue import CompileQueue
from pagedllm.structured_output.manager import StructuredOutputManager

WAIT = 60.0  # only a hang takes this long


def scope(auth: bytes | None = None, host: str = "10.0.0.7") -> dict:
    headers = [(b"authorization", auth)] if auth is not None else []
    return {"type": "http", "headers": headers, "client": (host, 51234)}


def identity(sc: dict, keys_checked: bool, user: str | None) -> str | None:
    token = _CONNECTION.set(connection_identity(sc, keys_checked))
    try:
        return client_id(user)
    finally:
        _CONNECTION.reset(token)


def test_the_client_is_the_checked_key_else_the_user_else_the_peer():
    keyed = identity(scope(b"Bearer sk-secret"), True, "alice")
    assert keyed.startswith("key:") and "sk-secret" not in keyed  # hashed, the user field ignored
    assert keyed == identity(scope(b"bearer sk-secret", host="10.0.0.8"), True, None)  # any address
    assert keyed != identity(scope(b"Bearer sk-other"), True, None)
    # keys not checked: a Bearer header proves nothing, so it is not an identity
    assert identity(scope(b"Bearer sk-secret"), False, None) == "peer:10.0.0.7"
    alice = identity(scope(), False, "alice")
    assert alice.startswith("user:") and "alice" not in alice
    assert alice == identity(scope(host="10.0.0.9"), False, "alice") != identity(scope(), False, "bob")
    assert identity(scope(), False, "") == "peer:10.0.0.7"
    assert identity({"type": "http", "headers": []}, False, None) == "peer:unknown"
    assert client_id("alice") is None  # outside an HTTP request: the engine charges the request itself


def big_schema(name: str) -> dict:
    """A schema over the small-lane size (4 KiB), named by its one property."""
    return {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name],
            "x-pad": "x" * 5000}


class CompileGate:
    """Every compile records its schema's name when it starts, then waits for one ``release()``."""

    def __init__(self, monkeypatch):
        self.started: list[str] = []
        self.finished: list[str] = []
        self.slots = threading.Semaphore(0)
        self.owners: list[str] = []
        compile_grammar, submit = StructuredOutputManager._compile, CompileQueue.submit

        def gated(manager, params):
            spec = json.loads(params.json) if isinstance(params.json, str) else params.json
            name = next(iter(spec["properties"]))
            self.started.append(name)
            assert self.slots.acquire(timeout=WAIT)
            compiled = compile_grammar(manager, params)
            self.finished.append(name)
            return compiled

        def recording(queue, job):
            self.owners.append(job.owner)
            return submit(queue, job)
        monkeypatch.setattr(StructuredOutputManager, "_compile", gated)
        monkeypatch.setattr(CompileQueue, "submit", recording)

    def wait_started(self, n: int) -> None:
        deadline = time.monotonic() + WAIT
        while len(self.started) < n:
            assert time.monotonic() < deadline, f"only {self.started} started"
            time.sleep(0.01)


def complete(url: str, key: str, schema: dict, user: str | None = None, timeout: float = WAIT):
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=timeout) as client:
        extra = {"structured_outputs": {"json": schema}}
        return client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra,
                                         **({"user": user} if user else {}))


def compile_metric(srv, name: str) -> float:
    metrics = srv.engine.engine.structured_output.metrics()
    return next(m.value for m in metrics if m.name == f"pagedllm:structured_output_{name}")


def queue_depth(srv) -> float:
    return compile_metric(srv, "compile_queue_depth")


def wait_queued(srv, n: int) -> None:
    deadline = time.monotonic() + WAIT
    while queue_depth(srv) < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_one_clients_big_schemas_hold_at_most_one_slot_ahead_of_another_client(server_model_dir,  # noqa: F811
                                                                              monkeypatch):
    gate = CompileGate(monkeypatch)
    srv = start_server(server_model_dir, api_key=["key-a", "key-b", "key-c"])
    pool = ThreadPoolExecutor(8)
    try:
        mine = [pool.submit(complete, srv.url, "key-a", big_schema(f"a{i}")) for i in range(5)]
        gate.wait_started(2)  # client A's first two fill both general compile threads
        wait_queued(srv, 3)  # its other three queue behind them
        theirs = pool.submit(complete, srv.url, "key-b", big_schema("b0"))
        wait_queued(srv, 4)
        gate.slots.release()  # one of A's compiles ends: the slot goes to B, whose queue was empty
        gate.wait_started(3)
        assert gate.started[2] == "b0", gate.started
        # a spec already compiled is a cache hit: it answers while every compile is still held
        hit = pool.submit(complete, srv.url, "key-c", big_schema(gate.finished[0])).result(WAIT)
        assert hit.choices[0].finish_reason in ("stop", "length") and len(gate.finished) == 1
        for _ in range(6):
            gate.slots.release()
        assert theirs.result(WAIT).choices and all(f.result(WAIT).choices for f in mine)
        # every spec compiled once (A's five arrive in any order); the hit compiled nothing
        assert sorted(gate.started) == ["a0", "a1", "a2", "a3", "a4", "b0"]
        owners = set(gate.owners)
        assert len(owners) == 2 and all(o.startswith("key:") for o in owners)  # A's five are one client
    finally:
        for _ in range(8):
            gate.slots.release()
        pool.shutdown(wait=True)
        srv.stop()


def test_without_keys_the_user_field_else_the_address_names_the_client(server_model_dir,  # noqa: F811
                                                                      monkeypatch):
    gate = CompileGate(monkeypatch)
    for _ in range(8):
        gate.slots.release()  # nothing waits here: only the owners are checked
    srv = start_server(server_model_dir)
    try:
        complete(srv.url, "unused", big_schema("u0"), user="alice")
        complete(srv.url, "unused", big_schema("u1"), user="alice")
        complete(srv.url, "unused", big_schema("u2"))
    finally:
        srv.stop()
    assert gate.owners[0] == gate.owners[1] and gate.owners[0].startswith("user:")
    assert gate.owners[2] == "peer:127.0.0.1"


def test_a_client_that_leaves_drops_its_queued_compile(server_model_dir, monkeypatch):  # noqa: F811
    """The issue's clients gave up on huge schemas after 5 s and their compiles ran anyway, holding
    the compile threads: a compile still queued when its client leaves is dropped, and the slot it
    would have taken serves the next client."""
    gate = CompileGate(monkeypatch)
    srv = start_server(server_model_dir)
    pool = ThreadPoolExecutor(4)
    try:
        busy = [pool.submit(complete, srv.url, "k", big_schema(f"a{i}")) for i in range(2)]
        gate.wait_started(2)  # both general compile threads held
        with pytest.raises(openai.APITimeoutError):
            complete(srv.url, "k", big_schema("gone"), timeout=1.0)
        deadline = time.monotonic() + WAIT
        while compile_metric(srv, "compiles_cancelled") < 1:  # the abort reaches the engine thread
            assert time.monotonic() < deadline, "the queued compile of a departed client was not dropped"
            time.sleep(0.02)
        assert queue_depth(srv) == 0
        for _ in range(3):
            gate.slots.release()
        assert all(f.result(WAIT).choices for f in busy)
        assert complete(srv.url, "k", big_schema("next")).choices
        assert "gone" not in gate.started and gate.started[-1] == "next"
    finally:
        for _ in range(4):
            gate.slots.release()
        pool.shutdown(wait=True)
        srv.stop()


@pytest.mark.parametrize("bad", ["", 7])
def test_an_invalid_client_id_is_refused_naming_it(bad):
    from pagedllm.engine.input_processor import ProcessedRequest, with_client
    from pagedllm.sampling_params import SamplingParams
    with pytest.raises(ValueError, match="client_id="):
        with_client(ProcessedRequest("r", "p", [1], SamplingParams()), bad)
