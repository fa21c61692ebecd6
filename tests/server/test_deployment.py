"""The server deployed like ``vllm serve``: TLS, API keys behind a root path, CORS from a browser
origin, request ids and logging, user middleware, docs off, vLLM's frontend flags; and the shutdown
deadline ending requests with a ``server_shutdown`` error."""
from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import ssl
import threading

import httpx
import openai
import pytest
from live_server import serve_process, server_model_dir, start_server

from pagedllm.entrypoints.http_common import HttpOptions, http_options_from_cli
from pagedllm.entrypoints.openai.cli_args import HONOURED, REFUSED, VLLM_FRONTEND_ARGS, VLLM_VERSION, check_refused_args

KEY = "sk-deploy"
ORIGIN = "https://app.example.com"


def make_self_signed(tmp_path) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1 (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    keyfile, certfile = tmp_path / "key.pem", tmp_path / "cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(keyfile), str(certfile)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def deployed(server_model_dir, tls_files):
    """HTTPS, an API key, CORS for ORIGIN, root path /proxy, request ids, logging, two user middlewares."""
    keyfile, certfile = tls_files
    options = HttpOptions(api_keys=(KEY,), allowed_origins=(ORIGIN,), root_path="/proxy",
                          enable_request_id_headers=True, enable_log_requests=True, max_log_len=20,
                          middleware=("deployment_middleware.TagMiddleware", "deployment_middleware.tag_function"),
                          ssl_keyfile=keyfile, ssl_certfile=certfile, uvicorn_log_level="warning")
    srv = start_server(server_model_dir, http_options=options)
    yield srv
    srv.stop()


def _trust(tls_files) -> ssl.SSLContext:
    """A client context trusting the test's self-signed certificate."""
    return ssl.create_default_context(cafile=tls_files[1])


def _client(srv, tls_files, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=srv.url, verify=_trust(tls_files), timeout=60, **kwargs)


# ---------------------------------------------------------------------- TLS, keys, root path
@pytest.mark.parametrize("prefix", ["/proxy/v1", "/v1"])
def test_openai_client_over_tls_with_key_behind_root_path(deployed, tls_files, prefix):
    client = openai.OpenAI(base_url=deployed.url + prefix, api_key=KEY,
                           http_client=httpx.Client(verify=_trust(tls_files)))
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    bad = openai.OpenAI(base_url=deployed.url + prefix, api_key="wrong",
                        http_client=httpx.Client(verify=_trust(tls_files)))
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_plain_http_and_unknown_ca_are_refused(deployed):
    with pytest.raises(httpx.ConnectError):  # the self-signed certificate is not trusted by default
        httpx.get(deployed.url + "/health", timeout=10)
    with pytest.raises(httpx.HTTPError):
        httpx.get(deployed.url.replace("https", "http") + "/health", timeout=10)


def test_probes_stay_open_and_docs_live_under_the_root_path(deployed, tls_files):
    with _client(deployed, tls_files) as http:
        assert http.get("/proxy/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/tokenize").status_code == 401  # everything else needs the key
        schema = http.get("/proxy/openapi.json").json()
        assert "/v1/completions" in schema["paths"] and schema["servers"] == [{"url": "/proxy"}]


# ---------------------------------------------------------------------- CORS
def test_cors_preflight_is_answered_before_the_key_check(deployed, tls_files):
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
    with _client(deployed, tls_files) as http:
        r = http.options("/proxy/v1/chat/completions", headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        # the browser's real request: answered with the CORS header, 401 included (the page can read it)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        ok = http.post("/proxy/v1/completions", json=body, headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        refused = http.post("/v1/completions", json=body, headers={"Origin": ORIGIN})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
        other = http.options("/v1/completions", headers={**headers, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


# ---------------------------------------------------------------------- request ids, logging, middleware
def test_request_id_echoed_or_made_and_requests_logged(deployed, tls_files, caplog):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "a prompt longer than twenty characters", "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="pagedllm.entrypoints.http_common"), _client(deployed, tls_files) as http:
        given = http.post("/v1/completions", json=body, headers={**auth, "X-Request-Id": "req-42"})
        made = http.post("/v1/completions", json=body, headers=auth)
    assert given.status_code == made.status_code == 200
    assert given.headers["x-request-id"] == "req-42"
    made_id = made.headers["x-request-id"]
    assert len(made_id) == 32 and int(made_id, 16) >= 0
    lines = [r.getMessage() for r in caplog.records]
    logged = [line for line in lines if line.startswith("request req-42: POST /v1/completions body=")]
    assert logged and logged[0].endswith("more characters)")  # cut at --max-log-len 20
    assert len(logged[0].split("body=", 1)[1].split("...")[0]) == 20
    assert f"request {made_id}: status 200" in lines


def test_user_middlewares_wrap_every_response(deployed, tls_files):
    with _client(deployed, tls_files) as http:
        r = http.get("/health")
    assert r.headers["x-tag"] == "class" and r.headers["x-tag-function"] == "yes"


def test_bad_middleware_is_refused_by_name(server_model_dir):
    from pagedllm.entrypoints.openai.api_server import build_app
    with pytest.raises(ValueError, match="middleware='no_such_module.Thing' cannot be imported"):
        build_app(_engine_args(server_model_dir), http_options=HttpOptions(middleware=("no_such_module.Thing",)))


def _engine_args(model_dir):
    from pagedllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=model_dir, block_size=8, num_gpu_blocks_override=32, max_model_len=64)


def test_disable_fastapi_docs(server_model_dir):
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import build_app
    on = TestClient(build_app(_engine_args(server_model_dir)))
    off = TestClient(build_app(_engine_args(server_model_dir), http_options=HttpOptions(disable_fastapi_docs=True)))
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert on.get(path).status_code == 200, path
        assert off.get(path).status_code == 404, path


# ---------------------------------------------------------------------- vLLM's flags
def _serve_args(*argv: str):
    from pagedllm.entrypoints.cli import build_parser
    return build_parser().parse_args(["serve", *argv])


def test_every_vllm_frontend_flag_has_a_rule_and_parses():
    assert VLLM_VERSION == "0.32.0"
    assert not HONOURED & REFUSED.keys()
    assert set(VLLM_FRONTEND_ARGS) == HONOURED | REFUSED.keys()
    args = _serve_args("m")
    missing = [name for name in VLLM_FRONTEND_ARGS if not hasattr(args, name)]
    assert not missing
    check_refused_args(args)  # every refused flag at vLLM's default is accepted


@pytest.mark.parametrize("argv, flag", [
    (["--tool-server", "demo"], "--tool-server"),
    (["--api-server-count", "4"], "--api-server-count"),
    (["--tool-parser-plugin", "my_parsers.py"], "--tool-parser-plugin"),
    (["--log-error-stack"], "--log-error-stack"),
    (["--enable-offline-docs"], "--enable-offline-docs"),
])
def test_vllm_flags_we_lack_are_refused_by_name(argv, flag, capsys):
    from pagedllm.entrypoints.cli import main
    assert main(["serve", "m", *argv]) == 2  # refused before any model is loaded
    err = capsys.readouterr().err
    assert flag in err and "is not supported" in err


def test_production_vllm_serve_command_line_parses_unchanged(tls_files):
    """A `vllm serve` line as vLLM's deployment docs write them (TLS, key, proxy, CORS, tools, logging)."""
    keyfile, certfile = tls_files
    line = ["meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0", "--port", "8443",
            "--api-key", "token-abc123", "--ssl-keyfile", keyfile, "--ssl-certfile", certfile,
            "--root-path", "/llm", "--allowed-origins", '["https://chat.example.com"]', "--allow-credentials",
            "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Authorization", "Content-Type"]',
            "--enable-request-id-headers", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
            "--disable-access-log-for-endpoints", "/health,/metrics", "--enable-log-requests", "--max-log-len", "200",
            "--served-model-name", "llama-3.1-8b", "--max-model-len", "8192", "--gpu-memory-utilization", "0.9",
            "--tensor-parallel-size", "1", "--enable-prefix-caching", "--dtype", "auto", "--swap-space", "4",
            "--max-num-seqs", "128", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
            "--chat-template-content-format", "string", "--response-role", "assistant",
            "--enable-prompt-tokens-details", "--return-tokens-as-token-ids", "--api-server-count", "1",
            "--trust-request-chat-template", "--default-chat-template-kwargs", '{"enable_thinking": false}',
            "--disable-fastapi-docs", "--middleware", "deployment_middleware.TagMiddleware"]
    from pagedllm.entrypoints.openai.api_server import _chat_options_from_cli
    args = _serve_args(*line)
    check_refused_args(args)
    options = http_options_from_cli(args)
    assert options.api_keys == ("token-abc123",) and options.tls and options.root_path == "/llm"
    assert options.allowed_origins == ("https://chat.example.com",) and options.allow_credentials
    assert options.disable_access_log_for_endpoints == ("/health", "/metrics") and options.max_log_len == 200
    chat = _chat_options_from_cli(args)
    assert chat.tool_call_parser == "llama3_json" and chat.default_chat_template_kwargs == {"enable_thinking": False}
    assert args.model_tag == "meta-llama/Llama-3.1-8B-Instruct" and args.served_model_name == ["llama-3.1-8b"]


@pytest.mark.parametrize("kwargs, word", [(dict(root_path="llm"), "root_path"),
                                          (dict(ssl_keyfile="/nope.pem", ssl_certfile="/nope.pem"), "ssl_keyfile"),
                                          (dict(ssl_certfile="/x.pem"), "ssl_keyfile and ssl_certfile"),
                                          (dict(ssl_cert_reqs=7), "ssl_cert_reqs"),
                                          (dict(max_log_len=-1), "max_log_len")])
def test_bad_http_options_name_the_option(kwargs, word):
    with pytest.raises(ValueError, match=word):
        HttpOptions(**kwargs)


# ---------------------------------------------------------------------- shutdown deadline
def _stream_events(url: str, started: threading.Event, events: list) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
                started.set()


def test_requests_past_the_shutdown_deadline_end_with_server_shutdown(server_model_dir):
    """The deadline (ShutdownGate.expire): streams get an error event and [DONE], plain requests 503,
    and the engine has nothing left running."""
    srv = start_server(server_model_dir, max_num_seqs=8)
    try:
        real_step = srv.engine.engine.step

        def slow_step():
            import time
            time.sleep(0.05)
            return real_step()
        srv.engine.engine.step = slow_step  # every stream is still running when the deadline comes
        started = [threading.Event() for _ in range(3)]
        events: list[list[str]] = [[] for _ in range(3)]
        streams = [threading.Thread(target=_stream_events, args=(srv.url, started[i], events[i]), daemon=True)
                   for i in range(3)]
        plain: dict = {}

        def post_plain() -> None:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 100, "ignore_eos": True}
            plain["response"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        poster = threading.Thread(target=post_plain, daemon=True)
        for t in [*streams, poster]:
            t.start()
        assert all(e.wait(60) for e in started)
        srv.on_loop(_expire(srv))
        for t in [*streams, poster]:
            t.join(30)
        for stream in events:
            assert stream[-1] == "data: [DONE]"
            error = json.loads(stream[-2].removeprefix("data: "))["error"]
            assert error["type"] == "server_shutdown" and error["message"] == "server shutting down"
        assert plain["response"].status_code == 503
        assert plain["response"].json()["error"]["type"] == "server_shutdown"
        late = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503
        assert srv.wait_idle().num_used_blocks == 0
    finally:
        srv.stop()


async def _expire(srv) -> None:
    srv.app.state.serving.shutdown_gate.expire()


def test_router_takes_the_same_deployment_flags():
    """`pagedllm router` parses the deployment flags and installs the same middlewares."""
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.router.app import build_router_app
    from pagedllm.entrypoints.router.config import RouterConfig
    args = build_parser().parse_args(["router", "--backend", "http://127.0.0.1:9", "--routing-policy", "round_robin",
                                      "--root-path", "/r", "--allowed-origins", f'["{ORIGIN}"]',
                                      "--enable-request-id-headers", "--disable-fastapi-docs"])
    app = build_router_app(RouterConfig(backends=("http://127.0.0.1:9",), policy="round_robin"), None,
                           http_options_from_cli(args))
    client = TestClient(app)  # no lifespan: nothing is forwarded, the router's own routes answer
    r = client.get("/r/router/backends", headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
    assert r.json()["backends"][0]["url"] == "http://127.0.0.1:9"
    preflight = client.options("/r/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert client.get("/docs").status_code != 200  # forwarded (no backend here), not the router's docs page


# ---------------------------------------------------------------------- reply flags
@pytest.fixture(scope="module")
def reply_server(server_model_dir):
    from pagedllm.entrypoints.openai.serving import ResponseOptions
    options = ResponseOptions(enable_force_include_usage=True, response_role="bot", sse_keep_alive_interval=0.2)
    srv = start_server(server_model_dir, response_options=options)
    yield srv
    srv.stop()


def test_force_include_usage_and_response_role(reply_server):
    client = openai.OpenAI(base_url=f"{reply_server.url}/v1", api_key="none")
    chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=3, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3  # no stream_options sent
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert reply.choices[0].message.role == "bot"
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, stream=True))
    assert stream[0].choices[0].delta.role == "bot" and stream[-1].usage.total_tokens > 0
    # no generation prompt: the reply continues the last message, in its role (vLLM's rule)
    cont = client.chat.completions.create(
        model="tiny", messages=[*messages, {"role": "assistant", "content": "Sure"}], max_tokens=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.choices[0].message.role == "assistant"


# ---------------------------------------------------------------------- data parallel
@pytest.fixture(scope="module")
def dp_deployed(server_model_dir, tls_files, tmp_path_factory):
    """``serve --data-parallel-size 2`` deployed like vLLM: HTTPS, a key, root path /llm, CORS, request ids.
    Yields (the router's https URL, the replicas' URLs)."""
    keyfile, certfile = tls_files
    flags = ["--data-parallel-size", "2", "--routing-policy", "round_robin", "--num-gpu-blocks-override", "64",
             "--max-model-len", "128", "--served-model-name", "tiny", "--uvicorn-log-level", "warning",
             "--shutdown-timeout", "2", "--health-check-interval", "0.5", "--api-key", KEY,
             "--ssl-keyfile", keyfile, "--ssl-certfile", certfile, "--root-path", "/llm",
             "--allowed-origins", json.dumps([ORIGIN]), "--enable-request-id-headers"]

    def ready(url: str) -> bool:
        try:
            return httpx.get(_https(url) + "/llm/health", verify=_trust(tls_files), timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    with serve_process(server_model_dir, tmp_path_factory.mktemp("dp-tls") / "server.log", flags,
                       startup_timeout=300, stop_timeout=60, ready=ready) as server:
        url = _https(server.url)
        backends = httpx.get(f"{url}/llm/router/backends", headers={"Authorization": f"Bearer {KEY}"},
                             verify=_trust(tls_files), timeout=10).json()["backends"]
        yield url, [b["url"] for b in backends]


def _https(url: str) -> str:
    return url.replace("http://", "https://", 1)


def test_data_parallel_router_serves_tls_key_and_root_path(dp_deployed, tls_files):
    """The router takes the deployment flags; the replicas serve plain HTTP on 127.0.0.1, paths without the root."""
    url, replicas = dp_deployed
    assert len(replicas) == 2 and all(r.startswith("http://127.0.0.1:") for r in replicas)
    client = openai.OpenAI(base_url=f"{url}/llm/v1", api_key=KEY, max_retries=0,
                           http_client=httpx.Client(verify=_trust(tls_files), timeout=120))
    for _ in range(2):  # round robin: one request on each replica
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    wrong = openai.OpenAI(base_url=f"{url}/llm/v1", api_key="wrong", max_retries=0,
                          http_client=httpx.Client(verify=_trust(tls_files)))
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(httpx.HTTPError):  # the router speaks only TLS
        httpx.get(url.replace("https://", "http://", 1) + "/health", timeout=10)
    for replica in replicas:  # plain HTTP, still behind the key (the router sends it)
        assert httpx.get(f"{replica}/health", timeout=10).status_code == 200
        assert httpx.get(f"{replica}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{replica}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert models.json()["data"][0]["id"] == "tiny"


def test_data_parallel_router_answers_cors_and_request_ids(dp_deployed, tls_files):
    url, _ = dp_deployed
    with httpx.Client(base_url=url, verify=_trust(tls_files), timeout=60) as http:
        preflight = http.options("/llm/v1/completions",
                                 headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
        r = http.get("/llm/v1/models", headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "dp-rid"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "dp-rid"


def test_silent_streams_send_keep_alive_comments(reply_server):
    engine = reply_server.engine.engine
    real_step = engine.step

    def slow_step():
        import time
        time.sleep(0.5)  # > the 0.2 s keep-alive interval between tokens
        return real_step()
    engine.step = slow_step
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{reply_server.url}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        client = openai.OpenAI(base_url=f"{reply_server.url}/v1", api_key="none")
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2, stream=True))
    finally:
        engine.step = real_step
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1].usage.completion_tokens == 2  # the openai client skips the comments


def test_config_file_fills_the_flags_the_command_line_leaves(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: some/model\nport: 8001\nmax-model-len: 4096\nenable_prefix_caching: false\n"
                      "served-model-name: [a, b]\nenable-request-id-headers: true\n"
                      'default-chat-template-kwargs: {"enable_thinking": false}\n')
    args = _serve_args("--port", "9000", "--config", str(config), "--max-model-len", "64")
    assert args.port == 9000 and args.max_model_len == 64  # the command line wins, before or after --config
    assert args.model == "some/model" and args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.enable_request_id_headers and args.default_chat_template_kwargs == {"enable_thinking": False}
    config.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        _serve_args("--config", str(config))


PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% for part in m['content'] %}{{ part['text'] }}"
                  "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("content_format, expected", [("auto", "<user>hi there<assistant>"),
                                                      ("openai", "<user>hi there<assistant>"),
                                                      ("string", "<user><assistant>")])
def test_chat_template_content_format(server_model_dir, content_format, expected):
    """A template that loops over content parts (vLLM's "openai" format) renders the text; "auto"
    detects it; "string" hands it a string, whose characters have no 'text' (the message is lost:
    why auto exists). HF templates trim the newline after a block tag."""
    from live_server import CHAT_TEMPLATE
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.openai.chat import render_chat
    from pagedllm.entrypoints.openai.chat_features import detect_content_format
    from pagedllm.entrypoints.openai.protocol import ChatMessage
    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    messages = [ChatMessage(role="user", content="hi there")]
    assert detect_content_format(PARTS_TEMPLATE) == "openai" and detect_content_format(CHAT_TEMPLATE) == "string"
    assert render_chat(tokenizer, PARTS_TEMPLATE, messages, True, content_format=content_format) == expected
    # the tokenizer's own (string) template under auto: unchanged
    assert render_chat(tokenizer, None, messages, True) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], add_generation_prompt=True, tokenize=False)
