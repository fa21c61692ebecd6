"""vLLM's operational routes (issue 31): /version, /ping, /server_info, /reset_prefix_cache,
/start_profile and /stop_profile, and sleep mode (/sleep, /wake_up, /is_sleeping) on a live
server: while asleep a completion is a 503, after /wake_up the same greedy completion comes back."""
from __future__ import annotations

import glob

import httpx
import openai
import pytest
from live_server import live_server, server_model_dir, start_server  # noqa: F401 - fixtures

import pagedllm

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def sleepy(server_model_dir):  # noqa: F811
    server = start_server(server_model_dir, api_key=KEY, enable_sleep_mode=True)
    yield server
    server.stop()


def complete(server, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    request = dict(model="tiny", prompt="the quick brown", max_tokens=5, temperature=0)
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(**request, stream=True))
    return client.completions.create(**request).choices[0].text


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60, **kwargs)


def is_sleeping(server) -> bool:
    return httpx.get(f"{server.url}/is_sleeping").json()["is_sleeping"]


def test_open_routes(sleepy):
    assert httpx.get(f"{sleepy.url}/version").json() == {"version": pagedllm.__version__}
    assert httpx.get(f"{sleepy.url}/ping").status_code == 200
    assert httpx.post(f"{sleepy.url}/ping").status_code == 200
    assert is_sleeping(sleepy) is False


def test_control_routes_take_the_api_key(sleepy):
    assert httpx.get(f"{sleepy.url}/server_info").status_code == 401
    assert httpx.post(f"{sleepy.url}/sleep").status_code == 401
    info = httpx.get(f"{sleepy.url}/server_info", headers=AUTH).json()
    assert info["version"] == pagedllm.__version__ and info["num_gpu_blocks"] == 256
    assert "enable_sleep_mode=True" in info["engine_config"]


def test_sleep_refuses_requests_and_wakes_to_the_same_output(sleepy):
    before = complete(sleepy)
    assert post(sleepy, "/sleep", params={"level": 1}).status_code == 200
    assert is_sleeping(sleepy) is True
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as err:
            complete(sleepy, stream)
        assert err.value.status_code == 503 and "wake_up" in err.value.message
    assert post(sleepy, "/wake_up").status_code == 200
    assert is_sleeping(sleepy) is False
    assert complete(sleepy) == before
    # level 2: the weights come back uninitialized until reloaded (vLLM's contract)
    assert post(sleepy, "/sleep", params={"level": 2}).status_code == 200
    assert post(sleepy, "/wake_up", params={"tags": "weights"}).status_code == 200
    assert is_sleeping(sleepy) is True
    sleepy.on_loop(sleepy.engine.collective_rpc("reload_weights"))
    assert post(sleepy, "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert complete(sleepy) == before


@pytest.mark.parametrize("path, params, match", [
    ("/sleep", {"level": 3}, "level=3"),
    ("/wake_up", {"tags": "everything"}, "tags=['everything']"),
])
def test_bad_sleep_parameters_are_400s(sleepy, path, params, match):
    r = post(sleepy, path, params=params)
    assert r.status_code == 400 and match in r.json()["error"]["message"]


def test_sleep_needs_sleep_mode(live_server):  # noqa: F811
    r = httpx.post(f"{live_server.url}/sleep")
    assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"]
    assert complete(live_server)  # still serving


def test_reset_prefix_cache(sleepy):
    complete(sleepy)
    sleepy.wait_idle()
    assert post(sleepy, "/reset_prefix_cache").status_code == 200


def test_profile_routes_write_a_trace(sleepy, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    r = post(sleepy, "/start_profile")
    assert r.status_code == 400 and "PAGEDLLM_TORCH_PROFILER_DIR" in r.json()["error"]["message"]
    monkeypatch.setenv("PAGEDLLM_TORCH_PROFILER_DIR", str(tmp_path))
    assert post(sleepy, "/start_profile").status_code == 200
    complete(sleepy)
    assert post(sleepy, "/stop_profile").status_code == 200
    assert len(glob.glob(str(tmp_path / "*.pt.trace.json"))) == 1
    assert post(sleepy, "/stop_profile").status_code == 400  # not running any more
