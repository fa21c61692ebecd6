"""``utils.graph_break``: start-up does not import torch._dynamo; compiling still breaks the graph."""
from __future__ import annotations

import subprocess
import sys

import torch

from pagedllm.utils import graph_break


def test_building_an_engine_does_not_import_dynamo(llama_dir):
    code = ("import sys\nfrom pagedllm import LLM\n"
            f"LLM({str(llama_dir)!r}, device='cpu', max_model_len=64, kv_cache_memory=2**22)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_apply_wraps_registered_methods_once_and_compiled_code_breaks_there():
    calls = []

    class Op:
        @graph_break
        def run(self, x):
            calls.append(torch.compiler.is_compiling())  # traced by dynamo: True; run eagerly: False
            return x + 1

    plain = Op.run
    assert plain.__name__ == "run"
    graph_break.apply_graph_breaks()
    wrapped = Op.run
    assert wrapped is not plain and getattr(wrapped, "_torchdynamo_disable", False)
    graph_break.apply_graph_breaks()
    assert Op.run is wrapped  # idempotent: not wrapped twice

    op = Op()
    fn = torch.compile(lambda x: op.run(x * 2) * 3, backend="eager")
    assert fn(torch.ones(2)).tolist() == [9.0, 9.0]
    assert calls == [False]  # the method ran outside the traced graph
