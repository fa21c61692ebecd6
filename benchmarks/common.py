"""Helpers the benchmark scripts share: the random ~34M Llama they run, its prompts, the pagedllm
engine options (declared by EngineArgs), the transformers baseline, tables, JSON and run metadata.

A script in benchmarks/ imports it as ``common``; importing it puts this checkout's pagedllm first
on ``sys.path`` and keeps the Hugging Face Hub offline.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))  # this checkout's pagedllm, not whatever is installed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pagedllm before torch: on an oversubscribed host it sets OMP_WAIT_POLICY=PASSIVE, which libgomp
# reads only when torch loads it (pagedllm/cpu_threads.py); a script importing torch first loses that
importlib.import_module("pagedllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedllm.engine import arg_utils  # noqa: E402

CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_DIR = BENCH_DIR / "results"

# ~34M parameters: 8 x 3.15M (layers) + 2 x 4.19M (untied embeddings and lm_head).
MODEL_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0, initializer_range=0.05)
# ~205M parameters: 16 x 11.8M (layers) + 2 x 8.4M (embeddings and lm_head), issue 15's "~200M random Llama".
MODEL_CONFIGS = {
    "34m": MODEL_CONFIG,
    "200m": dict(MODEL_CONFIG, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8),
}
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


# --------------------------------------------------------------------------- model and prompts


def make_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    """One prompt per length, random ids in [len(SPECIAL_TOKENS), vocab): no pad/bos/eos inside.
    Drawn as one flat stream, so equal lengths give the same prompts as an (n, length) draw."""
    rng = np.random.default_rng(seed)
    flat = rng.integers(len(SPECIAL_TOKENS), vocab, size=sum(lens)).tolist()
    ends = np.cumsum(lens).tolist()
    return [flat[end - n:end] for n, end in zip(lens, ends)]


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer ``<pad> <s> </s> t3 t4 ...``: every model id decodes to a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<pad>")


def default_model_dir(size: str = "34m") -> Path:
    """Where the random Llama of ``size`` (a MODEL_CONFIGS key) is cached, keyed by its config's crc."""
    key = zlib.crc32(json.dumps(MODEL_CONFIGS[size], sort_keys=True).encode())
    return CACHE_DIR / f"llama-{size}-random-{key:08x}"


def ensure_model(path: Path, config: dict = MODEL_CONFIG) -> Path:
    """Builds the random checkpoint of ``config`` once (seed 0) into ``path``; a finished one is reused."""
    if (path / "config.json").exists():
        return path
    import transformers as tf
    tmp = path.with_name(path.name + ".tmp")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    word_tokenizer(config["vocab_size"]).save_pretrained(tmp)
    os.replace(tmp, path)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter model in {path}")
    return path


# --------------------------------------------------------------------------- pagedllm engine


ENGINE_OPTIONS = ("max_num_batched_tokens", "max_num_seqs", "block_size", "attention_backend", "num_threads",
                  "kv_cache_memory", "device", "quantization", "dtype", "enforce_eager")


def fill_unset(args: argparse.Namespace, quick: dict, full: dict) -> None:
    """Sets each option the command line left None to its ``--quick`` or full-run default, so
    ``--quick`` never overrides a value given explicitly."""
    for key, default in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, default)


def add_engine_args(ap: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The pagedllm engine options of throughput.py and latency.py, declared by EngineArgs (read by engine_kwargs).

    --device and --num-threads apply to the transformers baseline too; --quantization to pagedllm only.
    ``exclude``: options the script declares itself (throughput.py: --quantization takes a list).
    """
    names = [n for n in ENGINE_OPTIONS if n not in exclude]
    arg_utils.add_engine_args(ap, names, title="pagedllm engine (--device and --num-threads: both systems)")
    ap.set_defaults(kv_cache_memory="1GiB", device="cpu", dtype="float32")


def engine_kwargs(args) -> dict:
    """LLM(...) keywords: the ENGINE_OPTIONS flags (dtype float32 unless asked), seed 0."""
    return {**{name: getattr(args, name) for name in ENGINE_OPTIONS}, "seed": 0}


def make_llm(model_dir: Path, args):
    from pagedllm import LLM
    return LLM(str(model_dir), **engine_kwargs(args))


def engine_info(llm) -> dict:
    e = llm.llm_engine
    kv = e.get_kv_cache_stats()
    return dict(num_blocks=kv.num_blocks, block_size=kv.block_size,
                attention_backend=type(e.executor.runner.backend).__name__,
                max_num_seqs=e.config.scheduler.max_num_seqs,
                max_num_batched_tokens=e.config.scheduler.max_num_batched_tokens,
                enable_prefix_caching=e.config.cache.enable_prefix_caching, device=str(e.config.device),
                layer_ops=e.config.layer_ops, cuda_graphs=e.executor.runner.decode_graphs is not None)


# --------------------------------------------------------------------------- transformers baseline


def load_hf(model_dir: Path, device: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    # ignore_eos as pagedllm/vLLM mean it: EOS may be generated and does not stop. (min_new_tokens
    # would instead mask EOS, and greedy outputs would differ wherever EOS is the argmax.)
    model.generation_config.eos_token_id = None
    return model


def prefix_agreement(a: list[list[int]], b: list[list[int]], lens: list[int]) -> float:
    """Mean fraction of each request's requested tokens on which the two greedy outputs agree."""
    fracs = []
    for x, y, n in zip(a, b, lens):
        k = next((i for i, (u, v) in enumerate(zip(x[:n], y[:n])) if u != v), n)
        fracs.append(k / n)
    return float(np.mean(fracs))


# --------------------------------------------------------------------------- reporting and metadata


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w)  # noqa: E731
                               for i, (x, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def save_json(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class JsonLineWorker:
    """A system under test kept loaded in its own process, answering one JSON line per JSON line
    (``llamacpp_runner.py``, ``neighbour.py --serve``): the first line it prints is its ``info``
    (once loaded); ``run`` sends a job and returns the answer. Between jobs it blocks on stdin,
    so it does not use a core while the other system runs. ``new_session``: start it in its own
    process group (for a caller that kills the group, with whatever the worker left behind)."""

    def __init__(self, cmd: list[str], name: str, env: dict[str, str] | None = None, new_session: bool = False):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     start_new_session=new_session)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def run(self, prompts: list[list[int]], output_lens: list[int]) -> dict:
        """One timed run: ``{"time_s", "outputs", ...}``."""
        return self.ask({"prompts": prompts, "output_lens": list(output_lens)})

    def ask(self, job: dict) -> dict:
        """Sends one job line, returns the answer line."""
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
