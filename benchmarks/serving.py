"""Online serving benchmark for any OpenAI-compatible server (in the manner of `vllm bench serve`).

Sends exactly ``--num-prompts`` streaming requests (Poisson arrivals at ``--request-rate``,
optionally capped at ``--max-concurrency`` in flight), then reports throughput, TTFT,
TPOT, ITL and end-to-end latency, and goodput under SLOs. Example::

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 512 --random-output-len 128 --request-rate 8 \\
        --goodput ttft:500 tpot:50

Definitions (all per successful request):
  TTFT  time from sending the request to the first streamed chunk carrying text
  ITL   each gap between consecutive text-carrying chunks
  TPOT  (e2e - ttft) / (output_tokens - 1); undefined for single-token outputs
  E2E   time from sending the request to the end of the stream
Output token counts come from the final ``usage`` chunk (``stream_options.include_usage``)
when the server sends one, else from the number of text-carrying chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SLO_KEYS = ("ttft", "tpot", "e2el")
METRIC_KEYS = ("ttft", "tpot", "itl", "e2el")

# Common English words: with a leading space each is a single token in most BPE vocabularies,
# so N words is close to N prompt tokens.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or "
    "had not but first one their its new after who they have her she two been other when there all "
    "during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made team just "
    "while house under water part light still power high small great open group long game play "
    "back line life book music film free story form river field town road tree north south"
).split()


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: the prompt text and its (approximate) token length."""

    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    """What was measured for one request. Times are in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    usage_reported: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def _sample_lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    """n integers uniform in [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _word_prompt(rng: random.Random, length: int) -> RequestSpec:
    """A prompt of ``length`` random common words (about ``length`` tokens)."""
    return RequestSpec(" ".join(rng.choice(_WORDS) for _ in range(length)), length, 0)


def _token_prompt(rng: random.Random, length: int, tokenizer: Any, vocab: Sequence[int]) -> RequestSpec:
    """A prompt decoded from ``length`` random ids drawn from ``vocab``; its length is re-measured
    by encoding the text again (decode/encode round trips can merge or split tokens)."""
    text = tokenizer.decode([rng.choice(vocab) for _ in range(length)])
    return RequestSpec(text, len(tokenizer.encode(text, add_special_tokens=False)), 0)


def _prompt_maker(rng: random.Random, tokenizer: Any) -> Any:
    """``length -> RequestSpec`` using random words, or random token ids when a tokenizer is given."""
    if tokenizer is None:
        return lambda length: _word_prompt(rng, length)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return lambda length: _token_prompt(rng, length, tokenizer, vocab)


def build_requests(args: argparse.Namespace, tokenizer: Any = None) -> list[RequestSpec]:
    """Build ``args.num_prompts`` requests for the ``random`` or ``fixed`` dataset.

    ``random``: distinct prompts, input/output lengths uniform within
    ``--random-range-ratio`` of ``--random-input-len`` / ``--random-output-len``.
    ``fixed``: the same prompt (``--fixed-prompt`` or one random prompt of exactly
    ``--random-input-len``) for every request, exactly ``--random-output-len`` tokens out.
    ``prefix``: ``--num-prefixes`` shared prompts of ``--prefix-len`` (system prompts), each
    request one of them (at random) followed by a distinct ``random`` prompt.
    """
    rng = random.Random(args.seed)
    n = args.num_prompts
    make = _prompt_maker(rng, tokenizer)
    if args.dataset == "fixed":
        spec = _fixed_spec(args, make, tokenizer)
        return [dataclasses.replace(spec, output_len=args.random_output_len)] * n
    prefixes = [make(args.prefix_len) for _ in range(args.num_prefixes)] if args.dataset == "prefix" else []
    in_lens = _sample_lengths(rng, args.random_input_len, args.random_range_ratio, n)
    out_lens = _sample_lengths(rng, args.random_output_len, args.random_range_ratio, n)
    specs = [dataclasses.replace(make(i), output_len=o) for i, o in zip(in_lens, out_lens)]
    return [_with_prefix(rng.choice(prefixes), s) for s in specs] if prefixes else specs


def _with_prefix(prefix: RequestSpec, spec: RequestSpec) -> RequestSpec:
    return RequestSpec(f"{prefix.prompt} {spec.prompt}", prefix.prompt_len + spec.prompt_len, spec.output_len)


def _fixed_spec(args: argparse.Namespace, make: Any, tokenizer: Any) -> RequestSpec:
    if not args.fixed_prompt:
        return make(args.random_input_len)
    text = args.fixed_prompt
    length = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else len(text.split())
    return RequestSpec(text, length, 0)


# --------------------------------------------------------------------------- requests


def build_payload(spec: RequestSpec, model: str, chat: bool, extra: dict | None = None) -> dict:
    """JSON body of a streaming completions or chat-completions request for ``spec``."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return {**body, **(extra or {})}


SSE_DONE = object()  # returned by parse_sse_line for "data: [DONE]"


def parse_sse_line(line: str) -> Any:
    """Parse one SSE line: a dict for ``data: {...}``, ``SSE_DONE`` for ``[DONE]``, None otherwise."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separator, ``:`` comment, ``event:``/``id:`` fields
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return SSE_DONE
    return json.loads(data)


def chunk_text(chunk: dict) -> str:
    """The generated text carried by a completions or chat-completions stream chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _record_chunk(result: RequestResult, chunk: dict, start: float, last: float | None) -> float | None:
    """Update ``result`` with one parsed chunk; returns the new last-token timestamp."""
    if "error" in chunk:
        raise RuntimeError(f"server error in stream: {chunk['error']}")
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
        result.usage_reported = True
    if not chunk_text(chunk):
        return last
    now = time.perf_counter()
    if last is None:
        result.ttft = now - start
    else:
        result.itl.append(now - last)
    if not result.usage_reported:
        result.output_tokens += 1
    return now


async def _consume_stream(response: httpx.Response, result: RequestResult, start: float) -> None:
    """Read SSE lines until ``[DONE]`` or end of stream, timing text-carrying chunks."""
    last: float | None = None
    async for line in response.aiter_lines():
        parsed = parse_sse_line(line)
        if parsed is SSE_DONE:
            break
        if isinstance(parsed, dict):
            last = _record_chunk(result, parsed, start, last)
    if last is None:
        raise RuntimeError("stream ended without any generated text")


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, prompt_len: int) -> RequestResult:
    """Send one streaming request and measure it; failures are returned, not raised."""
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:500]}")
            await _consume_stream(response, result, start)
        result.e2el = time.perf_counter() - start
        result.success = True
    except Exception as e:  # noqa: BLE001 - any failure is recorded per request
        result.error = f"{type(e).__name__}: {e}"
    return result


def arrival_delays(rate: float, n: int, rng: random.Random) -> list[float]:
    """Gaps before each of ``n`` requests: exponential (Poisson process) at ``rate``/s; 0 if inf."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


# --------------------------------------------------------------------------- metrics


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"invalid --goodput item {item!r}: expected KEY:MS with KEY in {SLO_KEYS}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"invalid --goodput item {item!r}: {value!r} is not a number") from None
        if slos[key] <= 0:
            raise ValueError(f"invalid --goodput item {item!r}: the SLO must be positive")
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms). A request without TPOT meets the TPOT SLO."""
    if not result.success:
        return False
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return all(values[k] is None or values[k] * 1000 <= limit for k, limit in slos.items())


def goodput(results: Sequence[RequestResult], slos: dict[str, float], duration: float) -> float:
    """Requests per second that succeeded and met all ``slos`` (ms) over ``duration`` seconds."""
    return sum(meets_slos(r, slos) for r in results) / duration if duration > 0 else 0.0


def _summary_ms(values: Sequence[float]) -> dict[str, float]:
    """mean / median / p99 / std of ``values`` (seconds), in milliseconds; NaN when empty."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan, "std": math.nan}
    arr = np.asarray(values, dtype=float) * 1000
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p99": float(np.percentile(arr, 99)), "std": float(arr.std())}


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate per-request results over a run lasting ``duration`` seconds."""
    ok = [r for r in results if r.success]
    inp = sum(r.prompt_len for r in ok)
    out = sum(r.output_tokens for r in ok)
    per = max(duration, 1e-9)
    metrics: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": inp, "total_output_tokens": out,
        "usage_reported": sum(r.usage_reported for r in ok),
        "request_throughput": len(ok) / per, "output_throughput": out / per,
        "total_token_throughput": (inp + out) / per,
        "ttft_ms": _summary_ms([r.ttft for r in ok]),
        "tpot_ms": _summary_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _summary_ms([g for r in ok for g in r.itl]),
        "e2el_ms": _summary_ms([r.e2el for r in ok]),
    }
    if slos:
        metrics["goodput_slos_ms"] = dict(slos)
        metrics["good_requests"] = sum(meets_slos(r, slos) for r in results)
        metrics["request_goodput"] = goodput(results, slos, per)
    return metrics


def format_table(metrics: dict[str, Any]) -> str:
    """Render ``metrics`` as a fixed-width text table."""
    def row(label: str, value: Any) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<42}{text:>12}"

    lines = ["{:=^54}".format(" Serving Benchmark Result "),
             row("Successful requests:", metrics["completed"]),
             row("Failed requests:", metrics["failed"]),
             row("Benchmark duration (s):", metrics["duration_s"]),
             row("Total input tokens:", metrics["total_input_tokens"]),
             row("Total generated tokens:", metrics["total_output_tokens"]),
             row("Request throughput (req/s):", metrics["request_throughput"])]
    if "request_goodput" in metrics:
        lines.append(row("Request goodput (req/s):", metrics["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", metrics["output_throughput"]),
              row("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    if "prefix_cache_hit_rate" in metrics:
        lines += [row("Prefix-cache hit rate (tokens):", metrics["prefix_cache_hit_rate"]),
                  row("Router prefix-affinity rate (requests):", metrics["router_affinity_rate"])]
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key in METRIC_KEYS:
        lines.append("{:-^54}".format(f" {names[key]} "))
        for stat in ("mean", "median", "p99"):
            lines.append(row(f"{stat.capitalize()} {key.upper()} (ms):", metrics[f"{key}_ms"][stat]))
    lines.append("=" * 54)
    return "\n".join(lines)


# --------------------------------------------------------------------------- driver


async def _resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first model listed by ``GET /v1/models``."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


async def _run_requests(client: httpx.AsyncClient, url: str, payloads: list[dict],
                        specs: list[RequestSpec], args: argparse.Namespace) -> list[RequestResult]:
    """Fire the requests on their Poisson schedule (bounded by --max-concurrency); gather results."""
    rng = random.Random(None if args.seed is None else args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(payload: dict, spec: RequestSpec) -> RequestResult:
        if limit is None:
            return await send_request(client, url, payload, spec.prompt_len)
        async with limit:
            return await send_request(client, url, payload, spec.prompt_len)

    tasks = []
    for delay, payload, spec in zip(arrival_delays(args.request_rate, len(specs), rng), payloads, specs):
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(payload, spec)))
    return list(await asyncio.gather(*tasks))


def _load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer  # heavy import: only when asked for

    return AutoTokenizer.from_pretrained(path)


# counters read from /metrics with --prefix-metrics (the router's exist only behind a pagedllm router)
PREFIX_COUNTERS = ("pagedllm:prefix_cache_hits_total", "pagedllm:prefix_cache_queries_total")
ROUTER_COUNTERS = ("pagedllm:router_requests_total", "pagedllm:router_prefix_affinity_hits_total")


async def _server_urls(client: httpx.AsyncClient, base_url: str) -> list[str]:
    """The servers whose engines answer: a pagedllm router's backends, else ``base_url`` itself."""
    response = await client.get(f"{base_url}/router/backends")
    if response.status_code == 200:
        return [b["url"] for b in response.json()["backends"]]
    return [base_url]


async def scrape_counters(client: httpx.AsyncClient, urls: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """Each counter in ``names`` summed over every label set and every server in ``urls``."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        text = (await client.get(f"{url}/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
    return totals


def prefix_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Hit rates over the run: prefix-cache hits / looked-up prompt tokens (the engines'), and
    the share of requests a router sent by prefix affinity (NaN without a router)."""
    delta = {k: after[k] - before[k] for k in before}
    queries, routed = delta[PREFIX_COUNTERS[1]], delta[ROUTER_COUNTERS[0]]
    return {"prefix_cache_hit_rate": delta[PREFIX_COUNTERS[0]] / queries if queries else math.nan,
            "router_affinity_rate": delta[ROUTER_COUNTERS[1]] / routed if routed else math.nan}


async def _prefix_snapshot(client: httpx.AsyncClient, base_url: str, servers: list[str]) -> dict[str, float]:
    return {**await scrape_counters(client, servers, PREFIX_COUNTERS),
            **await scrape_counters(client, [base_url], ROUTER_COUNTERS)}


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by parsed ``args``; returns the result dict (also saved/printed)."""
    base_url = args.base_url.rstrip("/")
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    specs = build_requests(args, _load_tokenizer(args.tokenizer))
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = args.model or await _resolve_model(client, base_url)
        payloads = [build_payload(s, model, chat, args.extra_body) for s in specs]
        servers = await _server_urls(client, base_url) if args.prefix_metrics else []
        before = await _prefix_snapshot(client, base_url, servers) if servers else None
        start = time.perf_counter()
        results = await _run_requests(client, base_url + args.endpoint, payloads, specs, args)
        duration = time.perf_counter() - start
        after = await _prefix_snapshot(client, base_url, servers) if servers else None
    metrics = compute_metrics(results, duration, args.goodput)
    if before is not None:
        metrics |= prefix_metrics(before, after)
    return {"date": datetime.now().isoformat(timespec="seconds"), "model": model,
            "config": _config_dict(args), "metrics": metrics,
            "requests": [dataclasses.asdict(r) | {"tpot": r.tpot} for r in results]}


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """JSON-safe copy of the arguments (inf rate and paths as strings)."""
    def safe(v: Any) -> Any:
        return str(v) if isinstance(v, Path) or (isinstance(v, float) and math.isinf(v)) else v

    return {k: safe(v) for k, v in vars(args).items()}


def default_result_file(model: str) -> Path:
    """``benchmarks/results/serving-<model>-<timestamp>.json``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    return RESULTS_DIR / f"serving-{safe}-{datetime.now():%Y%m%d-%H%M%S}.json"


def save_result(result: dict[str, Any], path: Path) -> None:
    """Write ``result`` as JSON atomically (via ``<path>.tmp``); NaN becomes null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_nan_to_none(result), indent=2))
    os.replace(tmp, path)


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive rate or 'inf', got {text!r}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _slos(text: str) -> str:
    parse_goodput([text])  # validate early so argparse names the flag
    return text


def build_parser() -> argparse.ArgumentParser:
    """Argument parser for the benchmark CLI."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="model name (default: first from GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path/id: build prompts from random token ids")
    p.add_argument("--num-prompts", type=_positive_int, default=100)
    p.add_argument("--dataset", choices=("random", "fixed", "prefix"), default="random",
                   help="prefix: each prompt is one of --num-prefixes shared prefixes + a random one")
    p.add_argument("--random-input-len", type=_positive_int, default=1024)
    p.add_argument("--random-output-len", type=_positive_int, default=128)
    p.add_argument("--random-range-ratio", type=_ratio, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")
    p.add_argument("--fixed-prompt", default=None, help="prompt text for --dataset fixed")
    p.add_argument("--prefix-len", type=_positive_int, default=512, help="shared prefix length (--dataset prefix)")
    p.add_argument("--num-prefixes", type=_positive_int, default=8, help="distinct shared prefixes (--dataset prefix)")
    p.add_argument("--prefix-metrics", action="store_true",
                   help="report the server's prefix-cache hit rate over the run (pagedllm /metrics; behind a "
                        "pagedllm router, summed over the backends it lists at /router/backends)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s, Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", type=_slos, default=None, metavar="KEY:MS",
                   help="SLOs in ms for goodput, KEY in ttft, tpot, e2el (e.g. ttft:500 tpot:50)")
    p.add_argument("--extra-body", type=_json_object, default=None, help="JSON merged into every request body")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--result-file", type=Path, default=None,
                   help="where to save JSON (default: benchmarks/results/serving-<model>-<time>.json)")
    p.add_argument("--no-save", action="store_true", help="do not write a result file")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse CLI arguments; ``--goodput`` becomes a ``{key: ms}`` dict."""
    args = build_parser().parse_args(argv)
    args.goodput = parse_goodput(args.goodput) if args.goodput else None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: run, print the table, save JSON. Exit 1 if every request failed."""
    args = parse_args(argv)
    result = asyncio.run(benchmark(args))
    print(format_table(result["metrics"]))
    failures = [r["error"] for r in result["requests"] if not r["success"]]
    if failures:
        print(f"{len(failures)} request(s) failed; first error: {failures[0]}", file=sys.stderr)
    if not args.no_save:
        path = args.result_file or default_result_file(result["model"])
        save_result(result, path)
        print(f"saved {path}")
    return 0 if result["metrics"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
