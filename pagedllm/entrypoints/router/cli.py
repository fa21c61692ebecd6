"""``pagedllm router --backend URL ...``: the router in front of running OpenAI-compatible servers."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
from dataclasses import fields

import httpx

from pagedllm import envs
from pagedllm.entrypoints.http_common import HttpOptions, add_http_args, http_options_from_cli, uvicorn_kwargs
from pagedllm.entrypoints.http_guards import add_limit_args, limits_from_cli
from pagedllm.entrypoints.openai.chat_features import load_chat_template
from pagedllm.models.loader import DEMO_MODEL_NAME, demo_model_path

from .app import build_router_app, load_hasher
from .backends import BackendPool
from .config import ROUTING_POLICIES, RouterConfig

_DEFAULTS = {f.name: f.default for f in fields(RouterConfig)}
# the routing flags' defaults (shared by both commands)
ROUTING_DEFAULTS = {"routing_policy": _DEFAULTS["policy"], "prefix_table_size": _DEFAULTS["prefix_table_size"],
                    "balance_threshold": _DEFAULTS["balance_threshold"],
                    "health_check_interval": _DEFAULTS["health_check_interval"],
                    "metrics_public": _DEFAULTS["metrics_public"]}


def add_routing_args(parser: argparse.ArgumentParser, title: str = "routing") -> None:
    """The routing flags shared by ``pagedllm router`` and ``pagedllm serve --data-parallel-size``."""
    g = parser.add_argument_group(title)
    d = ROUTING_DEFAULTS
    g.add_argument("--routing-policy", default=d["routing_policy"], choices=ROUTING_POLICIES,
                   help="prefix: the backend holding the longest cached prefix of the prompt, unless it is "
                        "--balance-threshold requests busier than the least loaded; least_loaded; round_robin "
                        "(prefix and least_loaded send a LoRA adapter's requests to a backend holding it)")
    g.add_argument("--prefix-table-size", type=int, default=d["prefix_table_size"],
                   help="prompt block hashes the router remembers (LRU, all backends together)")
    g.add_argument("--balance-threshold", type=int, default=d["balance_threshold"],
                   help="requests in flight the prefix holder (or a holder of the request's LoRA adapter; prefix "
                        "and least_loaded policies) may have beyond the least loaded backend")
    g.add_argument("--health-check-interval", type=float, default=d["health_check_interval"],
                   help="seconds between GET /health and /metrics probes of each backend")
    g.add_argument("--metrics-public", action="store_true",
                   help="with --api-key: leave the router's /metrics and /router/backends open (they list the "
                        "backends' URLs and load); /health is always open")


EXAMPLES = """examples:
  pagedllm router --backend http://10.0.0.2:8000 http://10.0.0.3:8000 --model Qwen/Qwen2.5-0.5B-Instruct
  pagedllm router --backend http://h1:8000 --backend http://h2:8000 --routing-policy least_loaded
  pagedllm router --prefill-replicas http://p1:8000 --decode-replicas http://d1:8000 --model MODEL
  pagedllm serve MODEL --data-parallel-size 2     # the same router in front of 2 local replicas
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help, examples kept as written."""


def register(subparsers) -> None:
    """Adds ``pagedllm router`` to the pagedllm CLI."""
    p = subparsers.add_parser("router", help="route requests across OpenAI-compatible servers (data parallelism)",
                              epilog=EXAMPLES, formatter_class=_HelpFormatter)
    p.add_argument("--backend", "--decode-replicas", dest="backend", action="extend", nargs="+", required=True,
                   metavar="URL", help="a backend server's root URL, e.g. http://10.0.0.2:8000 (repeatable); with "
                   "--prefill-replicas, the decode replicas (--kv-role consumer or both)")
    p.add_argument("--prefill-replicas", action="extend", nargs="+", default=[], metavar="URL",
                   help="prefill/decode disaggregation: replicas started with --kv-role producer (or both) and the "
                        "decode replicas' --kv-offload-remote; each completion and chat request is prefilled on one "
                        "(max_tokens=1), then decoded on a --backend replica from the shared KV pool")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--model", default=None, help="the backends' model: its tokenizer keys the prefix policy")
    p.add_argument("--tokenizer", default=None, help="the backends' tokenizer, when not --model's")
    p.add_argument("--trust-remote-code", action="store_true", help="let transformers run the tokenizer's code")
    p.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"], help="the backends' --block-size")
    p.add_argument("--chat-template", default=None, help="the chat template the backends were started with")
    p.add_argument("--startup-timeout", type=float, default=_DEFAULTS["startup_timeout"],
                   help="seconds each backend gets to pass GET /health before the router refuses to start")
    p.add_argument("--request-timeout", type=float, default=_DEFAULTS["request_timeout"],
                   help="seconds a backend may go silent during a request before the client gets 504")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (or set $PAGEDLLM_API_KEY)")
    p.add_argument("--backend-api-key", default=None,
                   help="the key to send the backends (Authorization: Bearer KEY) in place of the client's; "
                        "by default the client's Authorization header is passed on as it came")
    p.add_argument("--disable-dashboard", action="store_true",
                   help="no /dashboard page and no relays of the backends' /v1/kv_events and /v1/kv_snapshot (404)")
    add_routing_args(p)
    add_limit_args(p)
    add_http_args(p, api_key=False, uvicorn_log_level="warning")
    p.set_defaults(func=run_router)


def config_from_cli(args: argparse.Namespace, backends: tuple[str, ...], **fixed) -> RouterConfig:
    """The RouterConfig of the routing, limit and API key flags (both commands have them); ``fixed``
    supplies the rest (tokenizer, block size...)."""
    return RouterConfig(backends=backends, policy=args.routing_policy, prefix_table_size=args.prefix_table_size,
                        balance_threshold=args.balance_threshold, health_check_interval=args.health_check_interval,
                        api_key=api_key_from_cli(args), metrics_public=args.metrics_public,
                        disable_dashboard=getattr(args, "disable_dashboard", False),  # serve's flag with -dp
                        limits=limits_from_cli(args), **fixed)


def api_key_from_cli(args: argparse.Namespace) -> str | tuple[str, ...] | None:
    """``--api-key`` (the router's one key; ``serve``'s list of them, as parsed), else $PAGEDLLM_API_KEY
    (as the server reads it), else None."""
    key = args.api_key or envs.PAGEDLLM_API_KEY or None
    return tuple(key) if isinstance(key, list) else key


def run_router(args: argparse.Namespace) -> int:
    resolved = _resolved_tokenizer(args.tokenizer or args.model)
    config = config_from_cli(args, tuple(args.backend), tokenizer=resolved, trust_remote_code=args.trust_remote_code,
                             chat_template=load_chat_template(args.chat_template), block_size=args.block_size,
                             startup_timeout=args.startup_timeout, request_timeout=args.request_timeout,
                             backend_api_key=args.backend_api_key, prefill_backends=tuple(args.prefill_replicas))
    http_options = http_options_from_cli(args)
    asyncio.run(check_reachable(config))
    serve_router(config, args.host, args.port, args.uvicorn_log_level, http_options)
    return 0


def _resolved_tokenizer(name: str | None) -> str | None:
    """The bundled demo model's folder for its name; anything else goes to AutoTokenizer as given
    (a Hub id fetches only the tokenizer files, not the weights)."""
    return demo_model_path() if name == DEMO_MODEL_NAME else name


async def check_reachable(config: RouterConfig) -> None:
    """ValueError naming each backend that does not pass ``GET /health`` within ``startup_timeout``."""
    async with httpx.AsyncClient() as client:
        await BackendPool(config.all_backends, client).wait_reachable(config.startup_timeout)


def serve_router(config: RouterConfig, host: str, port: int, log_level: str,
                 http_options: HttpOptions | None = None) -> None:
    """Runs the router app until interrupted (then lets relayed requests finish for the limits'
    ``shutdown_timeout`` seconds; closing the rest makes their backends abort them);
    ``http_options``: the deployment flags (TLS, CORS, root path, request ids and logging,
    middleware), ``log_level`` overriding theirs."""
    import uvicorn

    http_options = dataclasses.replace(http_options or HttpOptions(), uvicorn_log_level=log_level)
    app = build_router_app(config, load_hasher(config), http_options)
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=config.limits.shutdown_timeout,
                **uvicorn_kwargs(http_options))
