"""llama.cpp side of ``throughput.py --compare-llamacpp``: a worker kept loaded in its own process.

Runs under the Python of a venv with llama-cpp-python (``python -m venv /tmp/llamacpp &&
/tmp/llamacpp/bin/pip install llama-cpp-python==0.3.36``), so neither system's libraries (two
OpenMP runtimes, two BLAS builds) share a process. Started once with the GGUF; it prints one
JSON line ``{"ready": ...}`` once the model is loaded, then answers each JSON line on stdin
``{"prompts": [[ids]], "output_lens": [n]}`` with ``{"time_s": s, "outputs": [[ids]]}``: every
prompt as a whole request (reset, prefill, greedy decode of exactly n tokens: no stop at EOS,
as pagedllm's ``ignore_eos``), one after another (llama-cpp-python's ``Llama`` serves one
sequence at a time). Between requests it blocks on stdin: it does not spin while pagedllm runs.

``convert(model_dir, converter, out)``: the F32 GGUF of an HF checkpoint with the converter that
llama-cpp-python's sdist ships (``vendor/llama.cpp/convert_hf_to_gguf.py``), run by this Python
(it has torch, transformers and numpy) with the sdist's ``gguf-py`` on its path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def convert(model_dir: Path, converter: Path, out: Path) -> Path:
    """``out`` (made once): the F32 GGUF of ``model_dir``. A checkpoint without a SentencePiece
    ``tokenizer.model`` (the benchmark's random Llama has a word-level ``tokenizer.json``, whose
    pre-tokenizer the converter refuses as unknown) is converted from a staging directory beside
    ``out`` holding its config and weights (links) and a stand-in SentencePiece model: the
    benchmarks hand both systems token ids, so the GGUF's vocabulary text is never used (the
    converter pads the token list to the config's ``vocab_size``). The converter imports
    ``sentencepiece`` either way: install it, or put it on ``PYTHONPATH``."""
    if out.exists():
        return out
    gguf_py = converter.parent / "gguf-py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(gguf_py), os.environ.get("PYTHONPATH")]))}
    source = model_dir if (model_dir / "tokenizer.model").exists() else stage_with_stand_in_vocab(model_dir, out, env)
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([sys.executable, str(converter), str(source), "--outtype", "f32", "--outfile", str(tmp)],
                   check=True, env=env)
    os.replace(tmp, out)
    return out


STAND_IN_VOCAB = """
import sentencepiece as spm, sys
words = " ".join(f"t{i}" for i in range(3, 200))
spm.SentencePieceTrainer.train(sentence_iterator=iter([words] * 20), model_prefix=sys.argv[1], vocab_size=64,
                               model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
"""


def stage_with_stand_in_vocab(model_dir: Path, out: Path, env: dict[str, str]) -> Path:
    """A directory with ``model_dir``'s config and weights (symlinks) and a 64-piece SentencePiece
    model (``<unk> <s> </s>`` at 0, 1, 2, as the random Llama's ``<pad> <s> </s>``)."""
    stage = out.with_name(out.stem + "-convert")
    stage.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            link = stage / f.name
            if not link.exists():
                link.symlink_to(f.resolve())
    made = subprocess.run([sys.executable, "-c", STAND_IN_VOCAB, str(stage / "tokenizer")], env=env,
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"the stand-in SentencePiece vocabulary could not be made with {sys.executable} "
                           "(the converter needs `sentencepiece` too: pip install sentencepiece, or put it on "
                           f"PYTHONPATH):\n{made.stderr.strip()[-1000:]}")
    return stage


def generate(llm, prompt: list[int], n: int) -> list[int]:
    """Greedy, exactly ``n`` tokens (no EOS stop), from an empty context."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def serve(gguf: str, threads: int, n_ctx: int) -> None:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                verbose=False)
    print(json.dumps({"ready": True, "llama_cpp": getattr(llama_cpp, "__version__", None),
                      "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        outputs = [generate(llm, p, n) for p, n in zip(job["prompts"], job["output_lens"])]
        print(json.dumps({"time_s": time.perf_counter() - t0, "outputs": outputs}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
