"""Prefill/decode disaggregation over the remote tier: what a replica's ``kv_role`` means, and
vLLM's ``--kv-transfer-config`` JSON read onto it.

A *producer* replica computes prompts (the router sends it each request with ``max_tokens=1``);
a *consumer* replica then gets the whole request, finds the prompt's blocks in the shared Redis
pool (the remote tier's prefix walk) and continues from there. The handoff is synchronous on the
producer: when a step finishes a request, the engine writes every full block of it to the pool
and waits for the writes to land (``LLMEngine.step``) before that request's last output leaves,
so the prefill response is the consumer's go-ahead. The other choice, a consumer polling the
pool until the blocks appear, needs to know what to wait for (a block count passed along) and
turns every real miss (evicted, a producer that failed) into a wait for the whole timeout; the
synchronous write costs the producer one pipelined ``SET`` round trip per finishing step, which
a replica that only prefills can afford. A block missing anyway (Redis evicted it, the server was
down) is a remote-tier miss: the consumer recomputes from there, with the same output.

=========  ================================================================  =====================
kv_role    writes to the remote tier                                          reads (prefix walk)
=========  ================================================================  =====================
None       write-through: blocks as their last request lets go, evictions     yes
producer   all of a finished request's full blocks, awaited before its        yes
           last output; evictions as above
consumer   never (it decodes what producers published)                        yes
both       as producer                                                        yes
=========  ================================================================  =====================

``producer`` and ``both`` behave alike in the engine; they differ in what a router may send them
(``both``: prefills and decodes).
"""
from __future__ import annotations

import json
from typing import Any

from pagedllm.config import KV_ROLES

# vLLM's kv_role names
VLLM_KV_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}
# the connector name --kv-transfer-config accepts: the remote tier is the only transport here
CONNECTOR = "PagedLLMRemoteTier"
# vLLM's KVTransferConfig keys other than kv_role / kv_connector, with the values that change nothing here
_INERT = {"engine_id": None, "kv_buffer_device": "cuda", "kv_buffer_size": 1e9, "kv_rank": None,
          "kv_parallel_size": 1, "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_connector_extra_config": {},
          "kv_connector_module_path": None, "enable_permute_local_kv": False,
          "kv_load_failure_policy": "recompute"}


def normalize_kv_role(role: str | None, name: str = "kv_role") -> str | None:
    """``producer`` / ``consumer`` / ``both`` (vLLM's ``kv_producer``... too), or None; ValueError else."""
    if role is None:
        return None
    if role in KV_ROLES:
        return role
    if role in VLLM_KV_ROLES:
        return VLLM_KV_ROLES[role]
    raise ValueError(f"{name}={role!r} is invalid: must be one of {KV_ROLES} (or vLLM's {tuple(VLLM_KV_ROLES)})")


def publishes_sync(role: str | None) -> bool:
    """A finished request's blocks are in the pool before its last output (producer, both)."""
    return role in ("producer", "both")


def writes_remote(role: str | None) -> bool:
    """The engine writes blocks to the remote tier at all (every role but consumer)."""
    return role != "consumer"


def kv_role_from_transfer_config(config: Any) -> str | None:
    """The ``kv_role`` of vLLM's ``kv_transfer_config`` (a dict or its JSON text), or None when unset.

    ``kv_connector`` must be unset or ``PagedLLMRemoteTier`` (vLLM's NIXL, P2P NCCL, LMCache or
    Mooncake connectors are not here: KV moves through ``--kv-offload-remote``); every other key must
    be at vLLM's default (``kv_load_failure_policy="recompute"`` is what the consumer does)."""
    if config is None:
        return None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            raise ValueError(f"kv_transfer_config={config!r} is not JSON: expected e.g. "
                             '\'{"kv_role": "kv_producer"}\'') from None
    if not isinstance(config, dict):
        raise ValueError(f"kv_transfer_config={config!r} must be a JSON object, e.g. "
                         '{"kv_role": "kv_consumer"}')
    connector = config.get("kv_connector")
    if connector not in (None, CONNECTOR):
        raise ValueError(f"kv_transfer_config kv_connector={connector!r} is not supported: pagedllm hands KV from "
                         f"prefill to decode replicas through its remote tier (--kv-offload-remote redis://...); "
                         f"use kv_connector={CONNECTOR!r} or leave it unset")
    for key, value in config.items():
        if key in ("kv_role", "kv_connector"):
            continue
        if key not in _INERT:
            raise ValueError(f"kv_transfer_config key {key!r} is not supported: known keys are kv_role, kv_connector "
                             f"and {sorted(_INERT)} (at vLLM's defaults)")
        if value != _INERT[key]:
            raise ValueError(f"kv_transfer_config {key}={value!r} is not supported: the remote tier has no such "
                             f"setting (accepted: {_INERT[key]!r})")
    if config.get("kv_role") is None:
        raise ValueError("kv_transfer_config needs a kv_role: kv_producer, kv_consumer or kv_both")
    return normalize_kv_role(config["kv_role"], "kv_transfer_config kv_role")
