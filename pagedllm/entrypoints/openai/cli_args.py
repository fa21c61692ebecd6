"""vLLM's frontend flags (``vllm serve``'s own, beside the engine's), as data: each is honoured, or
accepted only at a value that asks for nothing this server lacks and refused by name otherwise.

``vllm_frontend_args.json`` lists every FrontendArgs field of the vLLM release named in it, with its
default and type (read from vLLM's ``cli_args.py``), plus the flags ``make_arg_parser`` adds itself.
``HONOURED`` names those this server implements (their flags are declared where they are used:
http_common.add_http_args, api_server.make_arg_parser); ``REFUSED`` gives, for each of the others,
the values accepted (vLLM's default, and any value that changes nothing here) and the reason the
rest are refused. A test checks that the two together cover the file, so a vLLM command line
never meets argparse's "unrecognized arguments".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs

_DATA = json.loads(resources.files(__package__).joinpath("vllm_frontend_args.json").read_text(encoding="utf-8"))
VLLM_VERSION: str = _DATA["vllm_version"]
# name -> {"default", "type"[, "choices", "flags"]}: FrontendArgs' fields, then make_arg_parser's own
VLLM_FRONTEND_ARGS: dict[str, dict[str, Any]] = {**_DATA["frontend_args"], **_DATA["serve_args"]}

HONOURED = frozenset({
    "allow_credentials", "allowed_headers", "allowed_methods", "allowed_origins", "api_key", "chat_template",
    "chat_template_content_format", "config", "default_chat_template_kwargs",
    "disable_access_log_for_endpoints", "disable_fastapi_docs", "disable_uvicorn_access_log",
    "enable_auto_tool_choice", "enable_force_include_usage", "enable_log_requests",
    "enable_prompt_tokens_details", "enable_request_id_headers", "exclude_tools_when_tool_choice_none",
    "h11_max_incomplete_event_size", "headless", "host", "lora_modules", "max_log_len", "middleware", "port",
    "response_role",
    "return_tokens_as_token_ids", "root_path", "sse_keep_alive_interval", "ssl_ca_certs", "ssl_cert_reqs",
    "ssl_certfile", "ssl_ciphers", "ssl_keyfile", "tool_call_parser", "trust_request_chat_template", "uds",
    "uvicorn_log_level"})


@dataclass(frozen=True)
class Refused:
    """A vLLM flag accepted only at ``accepted`` values (vLLM's default first); ``reason``: why others are not."""

    accepted: tuple
    reason: str


def _at_default(reason: str, *also: Any) -> Refused:
    return Refused(("default", *also), reason)


_NO_MULTI_PORT = "there is no multi-port external load-balancing mode (--data-parallel-multi-port-external-lb)"
REFUSED: dict[str, Refused] = {
    "trust_request_mm_kwargs": _at_default("this server takes no multimodal requests"),
    "tool_parser_plugin": _at_default("tool parsers are built in: pick one with --tool-call-parser"),
    "tool_strict_level": _at_default("structural-tag tool calling is not available; tool_choice 'required' or a "
                                     "named function constrains the call instead"),
    "tool_server": _at_default("there are no built-in tools (no tool server)"),
    "enable_per_request_metrics": _at_default("replies carry no per-request timing; see /metrics"),
    "enable_server_load_tracking": _at_default("there is no /load endpoint; /metrics has the queue depths"),
    "enable_tokenizer_info_endpoint": _at_default("there is no /tokenizer_info endpoint"),
    "enable_log_outputs": _at_default("generated outputs are not logged (--enable-log-requests logs requests)"),
    "enable_log_deltas": _at_default("outputs are not logged, so there are no deltas to log", False),
    "cohere_is_reasoning_model": _at_default("there are no /cohere endpoints"),
    "cohere_format": _at_default("there is no cohere tokenizer mode"),
    "anthropic_disabled_thinking_effort": _at_default("there is no /v1/messages endpoint"),
    "log_error_stack": _at_default("error responses are not logged with their stack (unhandled errors are)"),
    "tokens_only": _at_default("there is no tokens-only (Tokens In<>Out) mode"),
    "enable_scale_out": _at_default("there are no scale-out endpoints (/render, /inference/v1/generate)"),
    "fingerprint_mode": _at_default("replies carry no system_fingerprint ('none' says so)", "none"),
    "fingerprint_value": _at_default("replies carry no system_fingerprint"),
    "grpc_port": _at_default("there is no gRPC frontend"),
    "data_parallel_supervisor_port": _at_default(_NO_MULTI_PORT),
    "dp_supervisor_probe_interval_s": _at_default(_NO_MULTI_PORT),
    "dp_supervisor_probe_timeout_s": _at_default(_NO_MULTI_PORT),
    "dp_supervisor_probe_failure_threshold": _at_default(_NO_MULTI_PORT),
    "enable_ssl_refresh": _at_default("certificates are read once at start; restart to load new ones"),
    "h11_max_header_count": _at_default("uvicorn has no header-count limit to set"),
    "enable_offline_docs": _at_default("the docs pages load their assets from the CDN (or use "
                                       "--disable-fastapi-docs)"),
    "enable_flash_late_interaction": _at_default("there is no late-interaction scoring, so no kernel to turn "
                                                 "off", False),
    "api_server_count": _at_default("one API server process serves every engine", 1),
    "grpc": _at_default("there is no gRPC server"),
}


def accepted_values(name: str) -> tuple:
    rule = REFUSED[name]
    default = VLLM_FRONTEND_ARGS[name]["default"]
    return tuple(default if value == "default" else value for value in rule.accepted)


def add_refused_args(parser: argparse.ArgumentParser) -> None:
    """Flags for every REFUSED name, parsed as vLLM parses them, so a vLLM command line parses and
    ``check_refused_args`` names the flag that asks for something unavailable."""
    g = parser.add_argument_group(f"vLLM {VLLM_VERSION} flags accepted only at the values shown")
    engine_flags = {f.name for f in dataclasses.fields(EngineArgs)}  # vLLM lists a few in both (tokens_only)
    for name, rule in REFUSED.items():
        if name in engine_flags:  # the engine flag parses it; check_refused_args still applies this rule
            continue
        spec = VLLM_FRONTEND_ARGS[name]
        shown = " or ".join(repr(v) for v in accepted_values(name))
        g.add_argument(*_flags(name, spec), dest=name, default=spec["default"],
                       help=f"accepted at {shown}: {rule.reason}", **_parse_kwargs(spec))


def _flags(name: str, spec: dict) -> list[str]:
    return ["--" + name.replace("_", "-"), *spec.get("flags", ())]


def _parse_kwargs(spec: dict) -> dict:
    """argparse's reading of a vLLM field's type (vLLM's get_kwargs rules for the types used here)."""
    kind = spec["type"]
    if kind == "bool":
        return {"action": argparse.BooleanOptionalAction}
    if kind.startswith("list"):
        return {"nargs": "*"}
    if kind.startswith("dict"):
        return {"type": json.loads}
    if kind.startswith("int"):
        return {"type": int}
    if kind.startswith("float"):
        return {"type": float}
    return {}


def check_refused_args(args: argparse.Namespace) -> None:
    """ValueError naming the first REFUSED flag set to a value this server cannot honour."""
    for name, rule in REFUSED.items():
        value = getattr(args, name, VLLM_FRONTEND_ARGS[name]["default"])
        if value not in accepted_values(name):
            flag = "--" + name.replace("_", "-")
            shown = " or ".join(repr(v) for v in accepted_values(name))
            raise ValueError(f"{flag}={value!r} is not supported: {rule.reason} (accepted: {shown})")


class ConfigFileAction(argparse.Action):
    """``--config FILE`` (vLLM's): a YAML mapping of flag names (``max-model-len`` or ``max_model_len``)
    to values, read as vLLM reads it (true: ``--flag``, false: ``--no-flag``, a list: its items, a
    mapping: JSON). A flag given on the command line wins over the file, before ``--config`` or after
    (one given before it at its default value reads as not given)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        fresh = parser.parse_args(config_file_argv(values, parser))
        for dest, value in vars(fresh).items():
            default = parser.get_default(dest)
            if value != default and getattr(namespace, dest, default) == default:
                setattr(namespace, dest, value)
        setattr(namespace, self.dest, values)


def config_file_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a ``--config`` YAML file stands for (vLLM's conversion)."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: cannot read it: {exc}")
    if not isinstance(config, dict):
        parser.error(f"--config {path}: must be a YAML mapping of flag names to values")
    argv: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            parser.error(f"--config {path}: a config file cannot name another one")
        if isinstance(value, bool):
            negative = f"--no-{flag[2:]}"
            if value:
                argv.append(flag)
            elif negative in parser._option_string_actions:  # a store_true flag's false is its default
                argv.append(negative)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)] if value else []
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv
