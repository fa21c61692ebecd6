"""The Triton JIT compiles a GPU run makes, counted and timed without a GPU (used by
benchmarks/device_rehearsal.sh to check gpu_check.sh's step limits).

As a pytest plugin (benchmarks/ on ``sys.path``, ``TRITON_INTERPRET=1``)::

    python -m pytest -p jit_variants --jit-log FILE tests/layers/triton_ops ...

it records every kernel launch the interpreted tests make (with the test's node id), keyed as
Triton's JIT keys a compile: the argument types, the ints it compiles in as constants (those
equal to 1), the 16-divisibility of ints and data pointers, the constexprs and the launch
options. On a GPU each distinct key is one JIT compile (a fresh machine has an empty cache).

    python benchmarks/probes/jit_variants.py FILE [FILE-gw0 ...] [--arch 90] [--tests -cpu]]

then compiles every distinct key (of the tests named) ahead of time for ``sm_<arch>`` (in a fresh cache, without the
interpreter) and prints the count and the seconds per kernel: the JIT time those launches cost on
the device, measured with this machine's CPU and the installed triton's compiler.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

_launches: set[str] = set()  # JSON of each distinct (launch key, test)
_current_test = [""]  # node id of the running test


# --------------------------------------------------------------------------- recording (pytest plugin)


def pytest_addoption(parser) -> None:
    parser.addoption("--jit-log", default=None, help="write the distinct Triton launch keys here (JSON lines)")


def pytest_configure(config) -> None:
    if config.getoption("--jit-log"):
        from triton.runtime.interpreter import InterpretedFunction
        original = InterpretedFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            key = launch_key(self.fn, args, kwargs) | {"test": _current_test[0]}
            _launches.add(json.dumps(key, sort_keys=True))
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        InterpretedFunction.run = run


def pytest_runtest_setup(item) -> None:
    _current_test[0] = item.nodeid


def pytest_unconfigure(config) -> None:
    path = config.getoption("--jit-log")
    if path:  # under pytest-xdist each worker writes its own file: FILE-gw0, FILE-gw1, ...
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        Path(f"{path}-{worker}" if worker else path).write_text("".join(line + "\n" for line in sorted(_launches)))


def launch_key(fn, args: tuple, kwargs: dict) -> dict:
    """What the JIT's cache key holds for one launch of ``fn`` (the Python function)."""
    # the JIT's own specializer (triton 3.6 to 3.9; not public API: tests/benchmarks/test_gpu_check.py pins it)
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    options = {k: v for k, v in kwargs.items() if k not in params}
    signature, constexprs = [], {}
    for name, value in bound.items():
        if "constexpr" in str(params[name].annotation):
            constexprs[name] = value
            continue
        kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":  # an int equal to 1 (or None): compiled in
            constexprs[name] = value
        else:
            signature.append([name, kind, attr])
    return dict(kernel=f"{fn.__module__}:{fn.__qualname__}", signature=signature, constexprs=constexprs,
                options=options)


# --------------------------------------------------------------------------- timing


def compile_key(key: dict, arch: int) -> float:
    """Compiles one launch key for ``sm_<arch>``; returns the seconds it took."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    module, name = key["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    signature = {n: kind for n, kind, _ in key["signature"]} | {n: "constexpr" for n in key["constexprs"]}
    signature = {n: signature[n] for n in fn.arg_names}  # the kernel's parameter order
    attrs = {(fn.arg_names.index(n),): BaseBackend.parse_attr(attr) for n, _, attr in key["signature"]
             if isinstance(attr, str)}
    src = triton.compiler.ASTSource(fn, signature, key["constexprs"], attrs)
    t0 = time.perf_counter()
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options=key["options"])
    return time.perf_counter() - t0


def time_all(keys: list[dict], arch: int) -> dict[str, tuple[int, float]]:
    """(compiles, seconds) per kernel name, each key compiled once in a fresh cache."""
    per_kernel: dict[str, list] = defaultdict(lambda: [0, 0.0])
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # before triton reads its knobs
        for key in keys:
            seconds = compile_key(key, arch)
            entry = per_kernel[key["kernel"].split(":")[1]]
            entry[0] += 1
            entry[1] += seconds
    return {name: (n, s) for name, (n, s) in sorted(per_kernel.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, nargs="+", help="--jit-log files; keys in several count once")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--tests", default="", help="only launches of tests whose node id contains this "
                    "(e.g. '-cpu]': the CPU twins of the `gpu` tests)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    keys = [json.loads(line) for path in args.log for line in path.read_text().splitlines() if line]
    distinct = {json.dumps({k: v for k, v in key.items() if k != "test"}, sort_keys=True)
                for key in keys if args.tests in key.get("test", "")}
    per_kernel = time_all([json.loads(key) for key in sorted(distinct)], args.arch)
    print(f"{'kernel':36s} {'compiles':>8s} {'seconds':>8s}")
    for name, (n, seconds) in per_kernel.items():
        print(f"{name:36s} {n:8d} {seconds:8.1f}")
    total_n, total_s = sum(n for n, _ in per_kernel.values()), sum(s for _, s in per_kernel.values())
    print(f"{'total (sm_' + str(args.arch) + ')':36s} {total_n:8d} {total_s:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
