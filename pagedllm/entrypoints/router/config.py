"""The router's options, validated once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pagedllm.config import check_block_size
from pagedllm.entrypoints.http_guards import ServerLimits
from pagedllm.utils import check_int, check_seconds

# prefix: longest cached prefix, balanced against load; least_loaded: fewest requests in flight;
# round_robin: in turn (the baseline the prefix policy is measured against)
ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    """What the router fronts and how it picks a backend.

    ``tokenizer`` (a path or Hub id), ``chat_template`` (the template text, as the replicas' server
    was given, or None for the tokenizer's own) and ``block_size`` (the replicas' ``--block-size``)
    let the prefix policy compute the same chained block hashes as the replicas' engines.
    ``prefix_table_size`` bounds the remembered block hashes (LRU, all backends together).
    ``balance_threshold``: when the backend holding the longest prefix (or the request's LoRA
    adapter) has more than this many requests in flight beyond the least loaded one, the least
    loaded one gets the request.

    ``prefill_backends``: prefill/decode disaggregation (replicas started with ``--kv-role producer``
    or ``both`` and a shared ``--kv-offload-remote``): each completion or chat request goes first to
    one of them with ``max_tokens=1`` (its answer discarded), then whole to one of ``backends`` (the
    decode replicas, ``--kv-role consumer`` or ``both``), which loads the prompt's blocks from the
    pool (``proxy.py``). Empty: every backend serves whole requests.

    ``api_key``: one key or several (``pagedllm serve --api-key K1 K2`` with data parallelism): clients
    must send ``Authorization: Bearer <one of them>`` on every route but
    ``/health`` (``/metrics`` and ``/router/backends`` too, unless ``metrics_public``).
    ``backend_api_key``: the key the router sends the backends in place of the client's
    ``Authorization`` (None: the client's header is passed on as it came). ``limits``: the request
    body size and read timeout (413/408, as the replicas) and the graceful shutdown timeout.
    """

    backends: tuple[str, ...]
    policy: str = "prefix"
    prefill_backends: tuple[str, ...] = ()
    tokenizer: str | None = None
    trust_remote_code: bool = False
    chat_template: str | None = None
    block_size: int = 16
    prefix_table_size: int = 65536
    balance_threshold: int = 8
    health_check_interval: float = 2.0
    startup_timeout: float = 10.0
    request_timeout: float = 600.0
    api_key: str | tuple[str, ...] | None = None
    backend_api_key: str | None = None
    metrics_public: bool = False
    disable_dashboard: bool = False  # no /dashboard and no /router/replicas/... relays (router/dashboard.py)
    limits: ServerLimits = field(default_factory=ServerLimits)

    def __post_init__(self):
        if not self.backends:
            raise ValueError("backends=() is invalid: give at least one --backend URL")
        for url in self.backends:
            check_backend_url(url)
        for name in ("backends", "prefill_backends"):
            urls = getattr(self, name)
            if len(set(urls)) != len(urls):
                raise ValueError(f"{name}={list(urls)} lists a URL twice: each backend once")
        for url in self.prefill_backends:
            check_backend_url(url)
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy={self.policy!r} is invalid: must be one of {ROUTING_POLICIES}")
        if self.policy == "prefix" and not self.tokenizer:
            raise ValueError("routing_policy='prefix' needs the replicas' tokenizer (--tokenizer or --model) to hash "
                             "prompts as they do; use --routing-policy least_loaded or round_robin without one")
        check_block_size(self.block_size)  # the replicas' --block-size: the engine's own rule
        check_int("prefix_table_size", self.prefix_table_size, 1)
        check_int("balance_threshold", self.balance_threshold, 0)
        self._check_prefix_only_options()
        for name in ("health_check_interval", "startup_timeout", "request_timeout"):
            check_seconds(name, getattr(self, name))
        self._check_keys()

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a client may send (none: every route is open)."""
        return () if self.api_key is None else (self.api_key,) if isinstance(self.api_key, str) else self.api_key

    @property
    def all_backends(self) -> tuple[str, ...]:
        """Every backend the router probes: the decode (or only) ones, then the prefill-only ones."""
        return self.backends + tuple(u for u in self.prefill_backends if u not in self.backends)

    def _check_keys(self) -> None:
        if isinstance(self.api_key, list):  # hashable, as the rest of a frozen config
            object.__setattr__(self, "api_key", tuple(self.api_key))
        keys = self.api_key if isinstance(self.api_key, tuple) and self.api_key else (self.api_key,)
        for name, value in [("api_key", key) for key in keys] + [("backend_api_key", self.backend_api_key)]:
            if value is not None and (not isinstance(value, str) or not value or not value.isprintable()):
                raise ValueError(f"{name} is invalid: must be a non-empty printable string, a list of them, "
                                 "or unset")
        for name in ("metrics_public", "disable_dashboard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be true or false")
        if self.metrics_public and self.api_key is None:
            raise ValueError("metrics_public=True applies only with an api_key (without one every route is public)")
        if not isinstance(self.limits, ServerLimits):
            raise ValueError(f"limits={self.limits!r} is invalid: must be a ServerLimits")

    def _check_prefix_only_options(self) -> None:
        """The prefix table exists only under the prefix policy, the load balance against affinity
        (prefix, LoRA adapter) under prefix and least_loaded: set with another policy they would be
        accepted and ignored."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        names = {"prefix": (), "least_loaded": ("prefix_table_size",)}.get(self.policy,
                                                                          ("prefix_table_size", "balance_threshold"))
        for name in names:
            if getattr(self, name) != defaults[name]:
                where = "'prefix'" if name == "prefix_table_size" else "'prefix' and 'least_loaded'"
                raise ValueError(f"{name}={getattr(self, name)!r} applies only to routing_policy={where}, not "
                                 f"{self.policy!r}; leave it unset")


def check_backend_url(url: str) -> str:
    """An ``http(s)://host:port`` root URL (no path beyond ``/``), else ValueError naming it."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment:
        raise ValueError(f"backend={url!r} is invalid: must be a server's root URL, e.g. http://10.0.0.2:8000")
    try:
        _ = parts.port  # raises ValueError on a port out of range
    except ValueError:
        raise ValueError(f"backend={url!r} is invalid: its port must be 0-65535") from None
    return url
