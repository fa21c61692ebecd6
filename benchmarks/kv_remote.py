"""The remote KV tier across replicas (``kv_tiers.py --remote``): two ``pagedllm serve`` replicas
behind ``pagedllm router``, a real ``redis-server`` shared by them (``--kv-offload-remote``).

Three clusters (same machine, same flags otherwise), each with its own fresh redis-server::

    no pool     2 replicas, no remote tier (today: each replica's prefix cache is an island)
    pool        2 replicas sharing the Redis pool (write-through, reads)
    P/D         1 --kv-role producer + 1 --kv-role consumer, the router's --prefill-replicas
    chunked     as "pool", with --max-num-batched-tokens --chunk (colocated serving's own answer
                to long prefills: smaller steps; only in the mixed workload)

"no pool" runs alone first; the others then run side by side (the idle ones cost little), so
their ``--rounds`` of the mixed workload alternate between them in one run (the machine's load
drifts: a ratio per round, its median reported).

Workloads (every request a completion on token ids, greedy; the router round-robins, so each
request lands on the other replica than the one before it, the case the pool is for; the
default prefix policy keeps a conversation on one replica while it is not overloaded):

* shared document: ``--docs`` documents of ``--doc-len`` tokens, each asked twice in a row (a new
  question each time): the second request is on the replica that never saw the document.
  Reported: its prefix-cache hit rate (hit tokens / the document's full-block tokens) and its
  TTFT against the first request's (cold). Targets: hit rate >= 0.7, TTFT <= 25 % of cold.
* multi-turn chat: ``--chats`` (odd) conversations, ``--turns`` turns, turn-major order: each turn
  (prompt = the previous turn's prompt + answer + a new user message) lands on the other replica.
  Reported: hit rate over turns after the first (hit tokens / the previous turn's full blocks).
* P/D vs colocated: ``--streams`` decode streams (short prompts, ``--stream-tokens`` tokens each)
  while ``--long-count`` prompts of ``--long-len`` tokens arrive ``--long-every`` seconds apart.
  Reported: p50/p99 inter-token latency of the decode streams and the long prompts' TTFT, on
  the pool cluster (colocated) and the P/D cluster, per round (new prompts each round), and the
  median over rounds of P/D p99 / colocated p99 ("pool", the CPU default of 2,048-token steps;
  and "chunked"). Target: <= 0.5.

Each replica gets ``--num-threads`` torch threads (default 1: two replicas on a 2-core machine).
Writes ``--out``_remote.json.

    python benchmarks/kv_tiers.py --remote            # 34M random Llama, 2048-token documents
    python benchmarks/kv_tiers.py --remote --quick    # 512-token documents, fewer requests
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import common  # noqa: E402  (puts this checkout's pagedllm first on sys.path)
import serving  # noqa: E402  (send_request: TTFT and inter-token gaps of one stream)

from pagedllm.entrypoints.router.data_parallel import free_port  # noqa: E402

MODEL_NAME = "bench"
QUICK = dict(doc_len=512, docs=2, chats=3, turns=3, chat_first_len=128, long_len=512, long_count=3, streams=2,
             stream_tokens=48, rounds=1)
FULL = dict(doc_len=2048, docs=4, chats=3, turns=4, chat_first_len=512, long_len=2048, long_count=4, streams=3,
            stream_tokens=96, rounds=3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--remote", action="store_true", help="(this benchmark; kv_tiers.py dispatches on it)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the random 34M Llama)")
    p.add_argument("--quick", action="store_true", help="shorter documents and fewer requests")
    for name in QUICK:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"(default {FULL[name]}; quick {QUICK[name]})")
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--user-len", type=int, default=24, help="tokens of each new chat message")
    p.add_argument("--answer-len", type=int, default=16, help="tokens each chat turn generates")
    p.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--chunk", type=int, default=256, help="the chunked cluster's --max-num-batched-tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--kv-cache-memory", default="512MiB", help="each replica's KV pool")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR / "kv_tiers", help="results path, no suffix")
    args = p.parse_args(argv)
    common.fill_unset(args, QUICK, FULL)
    if args.chats % 2 == 0:
        p.error(f"--chats={args.chats} must be odd: consecutive turns of a conversation then alternate replicas")
    return args


# --------------------------------------------------------------------------- processes


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(common.ROOT), PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    with log.open("w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:g} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def redis_server(logs: Path):
    """A fresh redis-server on a free port (no persistence, 2 GB, LRU); yields its URL."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("redis-server (or valkey-server) is needed: apt-get install redis-server")
    port = free_port()
    proc = _spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"], logs / f"redis-{port}.log")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop([proc])


@dataclass
class Cluster:
    """Running replicas and the router in front: ``url`` (the router), ``replicas`` (their URLs)."""

    url: str
    replicas: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)


@contextlib.contextmanager
def cluster(kind: str, model: str, args: argparse.Namespace, redis_url: str, logs: Path):
    """The ``kind`` cluster ("no pool", "pool", "P/D" or "chunked") started and healthy; stopped on exit."""
    roles = {"no pool": (None, None), "pool": ("", ""), "P/D": ("producer", "consumer"), "chunked": ("", "")}[kind]
    max_len = max(args.doc_len, args.long_len, args.chat_first_len + args.turns * (args.user_len + args.answer_len))
    replicas, procs = [], []
    try:
        for i, role in enumerate(roles):
            port = free_port()
            cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(port),
                   "--served-model-name", MODEL_NAME, "--block-size", str(args.block_size),
                   "--max-model-len", str(max_len + args.question_len + 256), "--num-threads", str(args.num_threads),
                   "--kv-cache-memory", args.kv_cache_memory, "--uvicorn-log-level", "warning"]
            if role is not None:
                cmd += ["--kv-offload-remote", redis_url] + (["--kv-role", role] if role else [])
            if kind == "chunked":
                cmd += ["--max-num-batched-tokens", str(args.chunk)]
            log = logs / f"{kind.replace('/', '')}-replica{i}.log"
            procs.append(_spawn(cmd, log))
            replicas.append((f"http://127.0.0.1:{port}", procs[-1], log))
        for url, proc, log in replicas:
            _wait_healthy(url, proc, log, args.startup_timeout)
        urls = [u for u, _, _ in replicas]
        port = free_port()
        backends = ["--backend", urls[1], "--prefill-replicas", urls[0]] if kind == "P/D" else ["--backend", *urls]
        log = logs / f"{kind.replace('/', '')}-router.log"
        procs.append(_spawn([sys.executable, "-m", "pagedllm.entrypoints.cli", "router", *backends, "--port",
                             str(port), "--routing-policy", "round_robin", "--health-check-interval", "1",
                             "--uvicorn-log-level", "warning"], log))
        _wait_healthy(f"http://127.0.0.1:{port}", procs[-1], log, 60)
        yield Cluster(f"http://127.0.0.1:{port}", urls, procs)
    finally:
        _stop(procs)


# --------------------------------------------------------------------------- requests


def scrape(urls: list[str], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples over the servers at ``urls`` (with these labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            total += sum(s.value for s in family.samples if s.name == name and labels.items() <= s.labels.items())
    return total


def payload(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int):
    result = await serving.send_request(client, f"{url}/v1/completions", payload(prompt, max_tokens, True),
                                        len(prompt))
    if not result.success:
        raise RuntimeError(result.error)
    return result


def complete(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    response = httpx.post(f"{url}/v1/completions", json=payload(prompt, max_tokens, False), timeout=600)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def full_block_tokens(n: int, block_size: int) -> int:
    """Tokens in the full blocks of an ``n``-token prefix (what a prefix cache can serve of it)."""
    return n // block_size * block_size


# --------------------------------------------------------------------------- workloads


async def shared_documents(c: Cluster, args: argparse.Namespace, vocab: int) -> dict:
    """Each document asked twice in a row: TTFT cold vs on the other replica, and that one's hit rate."""
    docs = common.make_prompts([args.doc_len] * args.docs, vocab, seed=100)
    questions = common.make_prompts([args.question_len] * (2 * args.docs), vocab, seed=101)
    cold, warm, rates = [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for d, doc in enumerate(docs):
            first = await stream_one(client, c.url, doc + questions[2 * d], 4)
            hits = scrape(c.replicas, "pagedllm:prefix_cache_hits_total")
            second = await stream_one(client, c.url, doc + questions[2 * d + 1], 4)
            rates.append((scrape(c.replicas, "pagedllm:prefix_cache_hits_total") - hits)
                         / full_block_tokens(args.doc_len, args.block_size))
            cold.append(first.ttft)
            warm.append(second.ttft)
    ratios = [w / c_ for w, c_ in zip(warm, cold)]
    return {"cross_replica_hit_rate": statistics.mean(rates), "ttft_cold_s": statistics.median(cold),
            "ttft_other_replica_s": statistics.median(warm), "ttft_ratio_median": statistics.median(ratios),
            "ttft_ratios": ratios}


def chats(c: Cluster, args: argparse.Namespace, vocab: int) -> dict:
    """Turn-major multi-turn chats; each turn on the other replica than its previous one."""
    firsts = common.make_prompts([args.chat_first_len] * args.chats, vocab, seed=200)
    users = common.make_prompts([args.user_len] * (args.chats * args.turns), vocab, seed=201)
    prompts = list(firsts)
    hit, hittable = 0.0, 0
    for turn in range(args.turns):
        for i in range(args.chats):
            if turn:
                prompts[i] = prompts[i] + users[turn * args.chats + i]
            before = scrape(c.replicas, "pagedllm:prefix_cache_hits_total")
            answer = complete(c.url, prompts[i], args.answer_len)
            if turn:
                hit += scrape(c.replicas, "pagedllm:prefix_cache_hits_total") - before
                # the previous turn's prompt and answer, less the answer's last token (never computed)
                hittable += full_block_tokens(len(prompts[i]) - args.user_len - 1, args.block_size)
            prompts[i] = prompts[i] + answer
    return {"cross_replica_hit_rate": hit / hittable if hittable else 0.0, "hit_tokens": hit,
            "hittable_tokens": hittable}


async def long_prefills_and_decodes(c: Cluster, args: argparse.Namespace, vocab: int, seed: int) -> dict:
    """Decode streams while long prompts arrive: the streams' inter-token gaps, the long prompts' TTFT."""
    shorts = common.make_prompts([32] * args.streams, vocab, seed=seed)
    longs = common.make_prompts([args.long_len] * args.long_count, vocab, seed=seed + 1)

    async def delayed(client: httpx.AsyncClient, k: int, prompt: list[int]):
        await asyncio.sleep(0.5 + k * args.long_every)
        return await stream_one(client, c.url, prompt, 4)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        streams = [stream_one(client, c.url, p, args.stream_tokens) for p in shorts]
        results = await asyncio.gather(*streams, *(delayed(client, k, p) for k, p in enumerate(longs)))
    gaps = sorted(g for r in results[:args.streams] for g in r.itl)
    long_ttft = [r.ttft for r in results[args.streams:]]

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000
    return {"itl_p50_ms": pct(0.5), "itl_p99_ms": pct(0.99), "itl_max_ms": gaps[-1] * 1000,
            "long_ttft_median_s": statistics.median(long_ttft), "num_gaps": len(gaps)}


def pool_metrics(c: Cluster) -> dict:
    return {"remote_hits_blocks": scrape(c.replicas, "pagedllm:kv_offload_hits_total", tier="remote"),
            "remote_misses": scrape(c.replicas, "pagedllm:kv_offload_misses_total", tier="remote"),
            "remote_read_round_trip_s_mean": _mean_round_trip(c.replicas),
            "router_remote_kv_hits": scrape([c.url], "pagedllm:router_remote_kv_hits")}


def run_sharing(c: Cluster, args: argparse.Namespace, vocab: int) -> dict:
    out = {"shared_document": asyncio.run(shared_documents(c, args, vocab)), "chat": chats(c, args, vocab)}
    print(f"{out}", flush=True)
    return out


def run_mixed(clusters: dict[str, Cluster], args: argparse.Namespace, vocab: int) -> dict:
    """``--rounds`` of the mixed workload, alternating between the clusters (new prompts each round)."""
    rounds: dict[str, list[dict]] = {kind: [] for kind in clusters}
    for r in range(args.rounds):
        for kind, c in clusters.items():
            rounds[kind].append(asyncio.run(long_prefills_and_decodes(c, args, vocab, seed=300 + 10 * r)))
            print(f"round {r} {kind}: {rounds[kind][-1]}", flush=True)
    ratios = [pd["itl_p99_ms"] / co["itl_p99_ms"] for pd, co in zip(rounds["P/D"], rounds["pool"])]
    chunked = [pd["itl_p99_ms"] / co["itl_p99_ms"] for pd, co in zip(rounds["P/D"], rounds["chunked"])]
    return {"rounds": rounds, "pd_vs_colocated_itl_p99_ratios": ratios,
            "pd_vs_colocated_itl_p99": statistics.median(ratios),
            "pd_vs_chunked_itl_p99_ratios": chunked, "pd_vs_chunked_itl_p99": statistics.median(chunked),
            **{f"{kind}_itl_p99_ms_median": statistics.median(r["itl_p99_ms"] for r in rs)
               for kind, rs in rounds.items()},
            **{f"{kind}_itl_p50_ms_median": statistics.median(r["itl_p50_ms"] for r in rs)
               for kind, rs in rounds.items()},
            **{f"{kind}_long_ttft_s_median": statistics.median(r["long_ttft_median_s"] for r in rs)
               for kind, rs in rounds.items()}}


def _mean_round_trip(urls: list[str]) -> float:
    count = scrape(urls, "pagedllm:kv_offload_round_trip_seconds_count", tier="remote", op="read")
    total = scrape(urls, "pagedllm:kv_offload_round_trip_seconds_sum", tier="remote", op="read")
    return total / count if count else 0.0


def report(results: dict) -> None:
    rows = []
    for kind in ("no pool", "pool"):
        doc, chat = results[kind]["shared_document"], results[kind]["chat"]
        rows.append([kind, f"{doc['cross_replica_hit_rate']:.2f}", f"{chat['cross_replica_hit_rate']:.2f}",
                     f"{doc['ttft_cold_s'] * 1000:.0f}", f"{doc['ttft_other_replica_s'] * 1000:.0f}",
                     f"{doc['ttft_ratio_median']:.2f}"])
    print(common.format_table(["cluster", "doc hit rate", "chat hit rate", "TTFT cold ms", "TTFT other replica ms",
                               "ratio"], rows))
    m = results["mixed"]
    print(common.format_table(["cluster", "ITL p50 ms", "ITL p99 ms", "long prompt TTFT ms"],
                              [[k, f"{m[f'{k}_itl_p50_ms_median']:.0f}", f"{m[f'{k}_itl_p99_ms_median']:.0f}",
                                f"{m[f'{k}_long_ttft_s_median'] * 1000:.0f}"] for k in ("pool", "chunked", "P/D")]))
    print(f"P/D p99 ITL / colocated, median of {len(m['pd_vs_colocated_itl_p99_ratios'])} rounds: "
          f"{m['pd_vs_colocated_itl_p99']:.2f} (target <= 0.5); / colocated chunked: {m['pd_vs_chunked_itl_p99']:.2f}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = args.model or str(common.ensure_model(common.default_model_dir()))
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model).vocab_size
    results: dict = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
                     | {"model": model, "cpus": os.cpu_count()}}
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedllm-kv-remote-")))
        with cluster("no pool", model, args, "", logs) as c:  # no remote tier: no server
            results["no pool"] = run_sharing(c, args, vocab)
        clusters = {kind: stack.enter_context(cluster(kind, model, args, stack.enter_context(redis_server(logs)),
                                                      logs)) for kind in ("pool", "P/D", "chunked")}
        results["pool"] = run_sharing(clusters["pool"], args, vocab)
        results["mixed"] = run_mixed(clusters, args, vocab)
        for kind, c in clusters.items():
            results[kind] = results.get(kind, {}) | pool_metrics(c)
    results["commit"] = common.git_commit()
    report(results)
    common.save_json(results, args.out.with_name(args.out.name + "_remote").with_suffix(".json"))
    return results


if __name__ == "__main__":
    main()
